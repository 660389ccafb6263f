"""sigmoid and silu of 16-bit floats on the IR's approximate exponential and reciprocal
(`UnaryOp.EXP_APPROX`, `RECIPROCAL_APPROX`: `__expf` and `__fdividef` on CUDA): used exactly
where the result is a 16-bit float, and as accurate as eager PyTorch (16-bit results of float32
math) against a float64 reference wherever the exact result is a finite normal number of the
type."""
import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.runtime import cuda as rt
from kiln.schedule.choose import check_nvrtc, choose

ops = kiln.ops
FUNCTIONS = {"sigmoid": (ops.sigmoid, torch.sigmoid), "silu": (ops.silu, F.silu)}
needs_nvrtc = pytest.mark.skipif(not rt.nvrtc_available(), reason="cuda-bindings / nvidia-cuda-nvrtc "
                                 "not installed: pip install 'kiln-core[cuda]'")


def _task(name, dtype):
    x = kiln.symbol([1000], dtype, "cuda")
    (node,) = kiln.graph.optimize(kiln.trace_from(FUNCTIONS[name][0](x), [x])).nodes
    return node.task


@needs_nvrtc
@pytest.mark.parametrize("name", sorted(FUNCTIONS))
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16bit_results_use_the_hardware_approximations(name, dtype):
    task = _task(name, dtype)
    source = choose(task, "cuda", 90).source
    assert "__expf(" in source and "__fdividef(" in source
    check_nvrtc(task, ("sm_80", "sm_90"))


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_32bit_results_keep_the_accurate_functions(name):
    source = choose(_task(name, "float32"), "cuda", 90).source
    assert "__expf(" not in source and "__fdividef(" not in source and "expf(" in source


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_the_cpu_computes_the_approximate_forms_exactly(name, dtype):
    kiln_fn, torch_fn = FUNCTIONS[name]
    x = (torch.randn(4099, dtype=torch.float64) * 6).to(dtype)
    want = torch_fn(x.double()).to(dtype)        # float32 math rounded once
    torch.testing.assert_close(kiln_fn(x).torch(), want, atol=0, rtol=torch.finfo(dtype).eps)


def _inputs(dtype):
    high = 11.0 if dtype == torch.float16 else 88.0          # e ** x stays finite in the type
    x = torch.linspace(-2 * high, high, 20011, dtype=torch.float64)
    return torch.cat([x, -x.flip(0)]).to(dtype).cuda()


@pytest.mark.cuda
@pytest.mark.parametrize("name", sorted(FUNCTIONS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_16bit_results_are_as_accurate_as_eager(name, dtype):
    kiln_fn, torch_fn = FUNCTIONS[name]
    x = _inputs(dtype)
    exact = torch_fn(x.double())
    got, eager = kiln_fn(x).torch(), torch_fn(x)
    info = torch.finfo(dtype)
    normal = (exact.abs() < info.max) & (exact.abs() >= info.tiny)
    error = lambda y: ((y.double() - exact).abs() / exact.abs())[normal]
    # rounding to the type costs up to half an ulp; the float32 math before it adds under 2^-16
    assert error(got).max().item() <= max(error(eager).max().item(), 0.5 * info.eps) * 1.02
    assert torch.equal(got.isnan(), eager.isnan()) and torch.equal(got.isinf(), eager.isinf())
