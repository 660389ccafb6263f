"""cumprod, cummax, cummin and logcumsumexp against PyTorch."""
import math

import pytest
import torch

import kiln
from tests.support import assert_close, rand


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32])
@pytest.mark.parametrize("dim", [0, -1])
def test_cumprod(dtype, dim):
    x = rand((5, 7), dtype, low=-2, high=2).t()
    assert_close(kiln.ops.cumprod(x, dim), torch.cumprod(x, dim), atol=1e-2 if dtype == torch.bfloat16 else None)


def test_cumprod_dtype():
    x = rand((4, 3), torch.int16)
    assert_close(kiln.ops.cumprod(x, 1, dtype=torch.float64), torch.cumprod(x, 1, dtype=torch.float64))


@pytest.mark.parametrize("op", ["cummax", "cummin"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int64, torch.uint8])
def test_running_extremes(op, dtype):
    """Ties (small integer ranges) take the last position, as PyTorch does."""
    x = rand((6, 9), dtype, low=-3, high=3).t()
    assert_close(getattr(kiln.ops, op)(x, 0), tuple(getattr(torch, op)(x, 0)))


@pytest.mark.parametrize("op", ["cummax", "cummin"])
def test_running_extremes_nan(op):
    x = rand((3, 8))
    x[0, 2], x[1, 5], x[1, 6] = math.nan, math.nan, math.nan
    assert_close(getattr(kiln.ops, op)(x, 1), tuple(getattr(torch, op)(x, 1)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_logcumsumexp(dtype):
    x = rand((4, 2, 9), dtype, low=-40, high=40).transpose(0, 2)
    assert_close(kiln.ops.logcumsumexp(x, 0), torch.logcumsumexp(x, 0))


def test_logcumsumexp_infinities():
    x = torch.tensor([[-math.inf, -math.inf, 1.0, math.inf, 2.0], [3.0, -math.inf, -1.0, 0.5, -math.inf]])
    assert_close(kiln.ops.logcumsumexp(x, 1), torch.logcumsumexp(x, 1))
