"""Tensor-core GEMMs with staged operands on the GPU (`kiln_ops_builtin.templates.stage`): K
not a multiple of eight, row-major B, transposed and strided views of A, batches, a fused
epilogue, and GPT-2's LM-head gradient shape in small, each against a float64 reference on
fresh random inputs, into NaN-poisoned outputs; then an LM head with cross-entropy trained
through torch.compile under bfloat16 autocast, its gradients against eager's error."""
import pytest
import torch

import kiln
from kiln.plugins.registry import registry
from tests.support import rand

pytestmark = pytest.mark.cuda

CALLS = {
    "odd_k": ("matmul", lambda dt: [rand((130, 1001), dt), rand((1001, 72), dt)], torch.matmul),
    "odd_k_linear_bias": ("linear", lambda dt: [rand((3, 50, 37), dt), rand((45, 37), dt), rand((45,), dt)],
                          torch.nn.functional.linear),
    "row_major_b": ("matmul", lambda dt: [rand((64, 128), dt), rand((128, 96), dt)], torch.matmul),
    "odd_k_batched": ("matmul", lambda dt: [rand((3, 20, 13), dt), rand((3, 13, 24), dt)], torch.matmul),
    "transposed_a": ("transposed_a", lambda dt: [rand((200, 67), dt), rand((200, 40), dt)],
                     lambda a, b: a.t() @ b),
}


def _task(op, args):
    if op == "transposed_a":        # A read through a transposing view of the first input
        from kiln.ir import Task, TensorInput, compute
        from kiln_ops_builtin.linalg import matmul
        src, b = (TensorInput(name, tuple(t.shape), kiln.from_torch(t).dtype) for name, t in zip("ab", args))
        a = compute(src.shape[::-1], lambda i, k: src[k, i])
        return Task("matmul", [src, b], [matmul.definition(a, b)], {})
    definition = registry().operator(op)
    return definition.task(definition.bind([kiln.from_torch(t) for t in args], {}))[0]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("call", list(CALLS))
def test_staged_gemm_matches_float64(call, dtype):
    from kiln.runtime.backend import backend_for
    from kiln_ops_builtin.templates import matmul_wgmma
    from kiln.runtime.cuda import arch_number, device_info
    if arch_number(device_info(0)["arch"]) < 90:
        pytest.skip("matmul_wgmma needs sm_90")
    op, make, reference = CALLS[call]
    args = [t.cuda() for t in make(dtype)]
    task = _task(op, args)
    for knobs in matmul_wgmma.TEMPLATE.space(1):
        runner = backend_for(kiln.device("cuda")).load(matmul_wgmma.render(task, **knobs), kiln.device("cuda"))
        out = torch.full(task.outputs[0].shape, float("nan"), dtype=dtype, device="cuda")
        runner(args, [out])
        torch.cuda.synchronize()
        expected = reference(*[t.double() for t in args])
        assert not out.isnan().any(), f"{knobs}: some outputs were never written"
        tol = {torch.float16: 1e-2, torch.bfloat16: 3e-2}[dtype]
        torch.testing.assert_close(out.double(), expected, atol=tol * expected.abs().max().item(), rtol=tol,
                                   msg=lambda m: f"{knobs}: {m}")


def test_lm_head_cross_entropy_gradients_under_autocast(fresh_dynamo):
    """The LM head's input gradient is [rows, vocab] @ [vocab, hidden] with an odd vocabulary."""
    torch.manual_seed(0)
    head = torch.nn.Linear(96, 1001, bias=False).cuda()
    x = torch.randn(4, 64, 96, device="cuda", requires_grad=True)
    labels = torch.randint(0, 1001, (4, 64), device="cuda")

    def loss_of(fn, inp):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return torch.nn.functional.cross_entropy(fn(inp).float().flatten(0, 1), labels.flatten())

    grads = {}
    for name, fn in (("eager", head), ("kiln", torch.compile(head, backend="kiln"))):
        inp = x.detach().clone().requires_grad_()
        head.zero_grad()
        loss_of(fn, inp).backward()
        grads[name] = (inp.grad.clone(), head.weight.grad.clone())
    reference = head.double()
    inp = x.detach().double().requires_grad_()
    torch.nn.functional.cross_entropy(reference(inp).flatten(0, 1), labels.flatten()).backward()
    want = (inp.grad, reference.weight.grad)
    for got, eager, exact in zip(grads["kiln"], grads["eager"], want):
        eager_error = (eager.double() - exact).abs().max().item()
        assert (got.double() - exact).abs().max().item() <= 2 * eager_error + 1e-6
