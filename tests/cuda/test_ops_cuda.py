"""Operators on a CUDA GPU against PyTorch: every family, several dtypes, fresh random inputs."""
import pytest
import torch

import kiln
from tests.cuda.cases import CASES
from tests.support import assert_close

pytestmark = pytest.mark.cuda

PARAMS = [pytest.param(c, d, id=f"{c.name}-{str(d).replace('torch.', '')}") for c in CASES for d in c.dtypes]


@pytest.mark.parametrize("case,dtype", PARAMS)
def test_operator_matches_torch(case, dtype):
    args, kwargs = case.make(dtype, "cuda")
    expected = case.reference(*args, **kwargs)
    actual = getattr(kiln.ops, case.op)(*args, **kwargs)
    if isinstance(expected, torch.Tensor):
        assert (actual.torch() if isinstance(actual, kiln.Tensor) else actual).device.type == "cuda"
    tol = dict(case.tol or {})
    if case.op in ("matmul", "linear", "conv2d", "conv1d") and dtype == torch.float32:
        tol = {"atol": 1e-4, "rtol": 1e-4}     # a different summation order than cuBLAS/cuDNN
    if case.op in ("matmul", "linear", "conv2d") and dtype == torch.float16:
        tol = {"atol": 1e-2, "rtol": 1e-2}
    assert_close(actual, expected, **tol)


def test_full_reduction_two_pass_matches_float64():
    x = torch.randn(3_000_000, device="cuda")
    assert_close(kiln.ops.sum(x), x.double().sum().float(), atol=1e-2, rtol=1e-5)


def test_long_rows_and_argmax_ties():
    x = torch.randint(0, 3, (5, 10000), device="cuda").float()
    assert_close(kiln.ops.argmax(x, dim=1), torch.argmax(x, dim=1))
    assert_close(kiln.ops.argmin(x, dim=1), torch.argmin(x, dim=1))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_templates_take_misaligned_views(dtype):
    """Inputs at an offset that breaks 16-byte alignment go through aligned copies."""
    flat = torch.randn(96 * 64 + 1, device="cuda").to(dtype)
    a = flat[1:].view(96, 64)                # data_ptr is 2 or 4 bytes past an allocation
    b = torch.randn(64, 80, device="cuda").to(dtype)
    assert a.data_ptr() % 16
    tol = 1e-2 if dtype == torch.float16 else 1e-4
    assert_close(kiln.ops.matmul(a, b), (a.double() @ b.double()).to(dtype), atol=tol, rtol=tol)
