"""Chains of 16-bit float element-wise operators compute in float32 and round once, where they
are stored (as Inductor does; eager rounds after every operator), and Python scalars multiply,
divide, add and subtract 16-bit floats unrounded (as PyTorch's CUDA kernels take them). GPT-2's
GELU (the tanh form of transformers' `gelu_new`) and its gradient under bfloat16 autocast are
the case (issue 32): reduced precision is compared against a float64 reference next to eager's
own error."""
import math

import pytest
import torch

import kiln
from kiln.ir import Binary, Cast, Task, TensorInput, compute, inline_task
from kiln.ir.expr import walk
from tests.support import relative_error

bf16 = torch.bfloat16


def gelu_tanh(x):
    """transformers' NewGELUActivation."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def _forward_backward(f, x, grad):
    x = x.clone().requires_grad_()
    y = f(x)
    y.backward(grad.to(y.dtype))
    return y.detach(), x.grad


def test_gelu_tanh_and_its_gradient_round_once_in_bfloat16():
    torch.manual_seed(0)
    x, grad = (torch.randn(64, 512) * 2).to(bf16), torch.randn(64, 512).to(bf16)
    y64, d64 = _forward_backward(gelu_tanh, x.double(), grad.double())
    y_eager, d_eager = _forward_backward(gelu_tanh, x, grad)
    torch._dynamo.reset()
    y, d = _forward_backward(torch.compile(gelu_tanh, backend="kiln"), x, grad)
    assert y.dtype == d.dtype == bf16
    # rounding the exact value once
    once_y, once_d = relative_error(y64.to(bf16), y64), relative_error(d64.to(bf16), d64)
    errors = {"forward": (relative_error(y, y64), relative_error(y_eager, y64), once_y),
              "backward": (relative_error(d, d64), relative_error(d_eager, d64), once_d)}
    for name, (kiln_error, eager_error, once) in errors.items():
        # eager rounds after each of its operators (4.1e-3 for the gradient, 1.5e-3 forward);
        # one rounding of float32's value is within a few percent of rounding float64's
        assert kiln_error <= 1.1 * once, f"{name}: Kiln {kiln_error:.3g}, rounding once {once:.3g}"
        assert kiln_error < eager_error, f"{name}: Kiln {kiln_error:.3g}, eager {eager_error:.3g}"
    assert errors["backward"][0] < 0.5 * errors["backward"][1]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_python_scalars_enter_unrounded(dtype):
    """x * 0.7978845608 scales by float32's 0.79788456, not by bfloat16's 0.796875; the same
    for division, addition and subtraction (alpha too) and for float16."""
    torch.manual_seed(0)
    x = torch.randn(4096).to(dtype)
    c = math.sqrt(2.0 / math.pi)
    cases = {
        "mul": (lambda t: t * c, lambda t: t * c),
        "div": (lambda t: t / 0.3, lambda t: t / 0.3),
        "add": (lambda t: t + 0.044715, lambda t: t + 0.044715),
        "sub": (lambda t: t - 0.044715, lambda t: t - 0.044715),
        "alpha": (lambda t: torch.add(t, t, alpha=0.3), lambda t: t + 0.3 * t),
    }
    for name, (f, exact) in cases.items():
        torch._dynamo.reset()
        got = torch.compile(f, backend="kiln")(x)
        assert got.dtype == dtype
        want = exact(x.double())
        assert (torch.equal(got, want.to(dtype))
                or relative_error(got, want) <= 1.05 * relative_error(want.to(dtype), want)), name


def test_comparisons_read_the_rounded_values():
    """A maximum and an equality test against it see the same (rounded) numbers: every row of
    a fused relu(x * 1.1 + 0.3) finds its maximum, as in eager."""
    torch.manual_seed(0)
    x = torch.randn(64, 33).to(bf16)

    def f(x):
        y = torch.relu(x * 1.1 + 0.3)
        return (y == y.amax(-1, keepdim=True)).sum(-1), y

    torch._dynamo.reset()
    hits, y = torch.compile(f, backend="kiln")(x)
    assert (hits >= 1).all()
    assert y.dtype == bf16


def test_inlined_16bit_computes_keep_float32_and_stores_round():
    """At the IR: the inlined chain has one rounding, at the stored output; a comparison reads
    the rounded value."""
    x = TensorInput("x", [8], kiln.dtypes.float32)
    f32, bf = kiln.dtypes.float32, kiln.dtypes.bfloat16
    a = compute([8], lambda i: x[i] * 3.0, dtype=bf)
    b = compute([8], lambda i: Cast(a[i], f32) + 1.0, dtype=bf)
    c = compute([8], lambda i: Cast(Cast(b[i], f32) > 2.0, f32) * Cast(b[i], f32), dtype=bf)
    (out,) = inline_task(Task("t", [x], [c])).outputs
    roundings = [e for e in walk(out.value) if isinstance(e, Cast) and e.dtype == bf]
    compared = [e for e in walk(out.value) if isinstance(e, Binary) and e.op.value == "gt"]
    assert len(compared) == 1 and any(isinstance(e, Cast) and e.dtype == bf for e in walk(compared[0]))
    outside = [e for e in roundings if not any(e is r for r in walk(compared[0]))]
    assert len(outside) == 1 and outside[0] is out.value      # the store's rounding only


def test_cuda_gelu_gradient_kernel_rounds_once_and_compiles():
    """On CUDA (traced without a GPU): the fused gradient kernel of a bfloat16 tanh chain stores
    with its only rounding and scales by float32's constant; with NVRTC, it compiles for sm_80
    and sm_90."""
    from kiln.runtime import cuda as rt
    from kiln.schedule.choose import check_nvrtc, choose
    ops = kiln.ops
    g = kiln.symbol([512, 1024], "bfloat16", "cuda")
    t = ops.tanh(ops.mul(g, math.sqrt(2.0 / math.pi)))
    graph = kiln.trace_from([ops.mul(ops.mul(g, ops.sub(1.0, ops.mul(t, t))), g)], [g])
    (node,) = kiln.graph.optimize(graph).nodes
    body = choose(node.task, "cuda", 90).source.split('extern "C"')[-1]
    assert body.count("kiln_f2bf(") == 1 and "0.79788" in body
    if rt.nvrtc_available():
        check_nvrtc(node.task, ("sm_80", "sm_90"))
