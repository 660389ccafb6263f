"""The Hopper GEMM engine (`gemm_sm90`) on the GPU: every knob setting of its level-1 space and
its suggestions and the packed epilogues, both B layouts (x @ W and x @ W.T), a column-major A
(a transpose fused into the matmul), batched matmuls with broadcasting, odd M and N, fused bias;
float16 and bfloat16, and float32 on TF32 tensor cores (K-major operands, `allow_tf32`), against
a float64 reference on fresh random inputs, into NaN-poisoned outputs."""
import pytest
import torch

import kiln
from kiln.plugins.registry import registry
from tests.support import rand

pytestmark = pytest.mark.cuda

CALLS = {
    "nn_odd": ("matmul", lambda dt: [rand((1000, 776), dt), rand((776, 4104), dt)], torch.matmul),
    "linear_odd": ("linear", lambda dt: [rand((1000, 776), dt), rand((4104, 776), dt), rand((4104,), dt)],
                   torch.nn.functional.linear),
    "linear_3d": ("linear", lambda dt: [rand((3, 45, 768), dt), rand((2304, 768), dt), rand((2304,), dt)],
                  torch.nn.functional.linear),
    "bmm_qk": ("matmul", lambda dt: [rand((12, 128, 64), dt), rand((12, 64, 128), dt)], torch.matmul),
    "bmm_pv_odd": ("matmul", lambda dt: [rand((2, 3, 200, 136), dt), rand((2, 3, 136, 72), dt)], torch.matmul),
    "bmm_broadcast": ("matmul", lambda dt: [rand((2, 3, 70, 64), dt), rand((3, 64, 40), dt)], torch.matmul),
    "bmm_shared_b": ("matmul", lambda dt: [rand((4, 130, 96), dt), rand((96, 264), dt)], torch.matmul),
}
DTYPES = (torch.float16, torch.bfloat16)
TF32_CALLS = ("linear_odd", "linear_3d")    # TF32 operands are K-major only


def _task(op, args):
    definition = registry().operator(op)
    tf32 = {"allow_tf32": True} if args[0].dtype == torch.float32 else {}
    return definition.task(definition.bind([kiln.from_torch(t) if isinstance(t, torch.Tensor) else t
                                            for t in args], tf32))[0]


def _programs():
    from kiln_ops_builtin.templates import gemm_sm90
    for call, (op, make, _) in CALLS.items():
        for dtype in DTYPES + ((torch.float32,) if call in TF32_CALLS else ()):
            task = _task(op, make(dtype))
            assert gemm_sm90.applies(task), call
            settings = []
            for knobs in gemm_sm90.TEMPLATE.space(1) + gemm_sm90.suggest(task, 132)[:3]:
                if knobs not in settings:
                    settings.append(knobs)
            for knobs in settings:
                yield pytest.param(call, dtype, knobs,
                                   id=f"{call}-{str(dtype)[6:]}-{'-'.join(f'{k}{v}' for k, v in sorted(knobs.items()))}")


def _check(out, expected):
    assert not out.isnan().any(), "some outputs were never written"
    err = ((out.double() - expected).norm() / expected.norm()).item()
    assert err < (2e-3 if out.dtype == torch.float32 else 1e-2), f"relative error {err}"   # TF32: 10-bit mantissas
    tol = 1e-2 if out.dtype in (torch.float16, torch.float32) else 3e-2
    torch.testing.assert_close(out.double(), expected, atol=tol * expected.abs().max().item(), rtol=tol)


@pytest.mark.parametrize("call,dtype,knobs", list(_programs()))
def test_gemm_sm90_matches_float64(call, dtype, knobs):
    _run(call, dtype, knobs)


PACKED_SETTINGS = [{"PACKED": 0}, {"BN": 128, "CW": 2, "MI": 2, "STAGES": 6, "PP": 1, "CLUSTER": 1},
                   {"BN": 192, "CW": 2, "MI": 1, "STAGES": 5, "PP": 1, "CLUSTER": 1}]


@pytest.mark.parametrize("knobs", PACKED_SETTINGS, ids=lambda k: "-".join(f"{a}{v}" for a, v in k.items()))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("call", list(CALLS))
def test_packed_epilogue(call, dtype, knobs):
    """Packed epilogues on tiles of two slabs a consumer and of 192 columns, and the float32-staged
    one, over GemmKnobs' defaults (clustered ping-pong, packed): odd M and N, batches, bias."""
    _run(call, dtype, knobs)


def _run(call, dtype, knobs):
    """`call` at `dtype` by gemm_sm90 at the setting `knobs`, against float64."""
    from kiln.runtime.backend import backend_for
    from kiln.runtime.cuda import arch_number, device_info
    from kiln_ops_builtin.templates import gemm_sm90
    if arch_number(device_info(0)["arch"]) < 90:
        pytest.skip("gemm_sm90 needs sm_90")
    op, make, reference = CALLS[call]
    args = [t.cuda() for t in make(dtype)]
    task = _task(op, args)
    runner = backend_for(kiln.device("cuda")).load(gemm_sm90.render(task, **knobs), kiln.device("cuda"))
    out = torch.full(task.outputs[0].shape, float("nan"), dtype=dtype, device="cuda")
    runner(args, [out])
    torch.cuda.synchronize()
    _check(out, reference(*[t.double() for t in args]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_transposed_a_fused_into_gemm(dtype):
    """A transpose feeding a matmul is read column-major through the tensor map (no copy)."""
    from kiln.runtime.cuda import arch_number, device_info
    if arch_number(device_info(0)["arch"]) < 90:
        pytest.skip("gemm_sm90 needs sm_90")
    a, b = rand((776, 1000), dtype).cuda(), rand((776, 520), dtype).cuda()
    compiled = torch.compile(lambda x, y: torch.relu(x.t() @ y), backend="kiln")
    out = compiled(a, b)
    _check(out, torch.relu(a.double().t() @ b.double()))


def test_tf32_follows_torchs_flag():
    """With torch's allow_tf32 a float32 linear runs on gemm_sm90's TF32 path; without it, in
    float32. The tensor cores read float32 operands by dropping their low 13 bits (toward zero)
    where cuBLAS rounds them first: on an H100 Kiln's error was 2.6x cuBLAS's (7.9e-4 against
    3.0e-4 relative), so the bound is 3x, and still far below 1e-2."""
    from kiln.runtime.cuda import arch_number, device_info
    if arch_number(device_info(0)["arch"]) < 90:
        pytest.skip("gemm_sm90 needs sm_90")
    x, w = rand((999, 776), torch.float32).cuda(), rand((1032, 776), torch.float32).cuda()
    expected = x.double() @ w.double().t()
    rel = lambda out: ((out.double() - expected).norm() / expected.norm()).item()
    previous = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch._dynamo.reset()
        tf32 = torch.compile(torch.nn.functional.linear, backend="kiln")(x, w)
        cublas = rel(torch.nn.functional.linear(x, w))
        assert 1e-6 < rel(tf32) <= 3 * cublas + 1e-6, (rel(tf32), cublas)   # TF32, not float32
        torch.backends.cuda.matmul.allow_tf32 = False
        torch._dynamo.reset()
        full = torch.compile(torch.nn.functional.linear, backend="kiln")(x, w)
        assert rel(full) < 1e-6
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous
        torch._dynamo.reset()
