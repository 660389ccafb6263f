"""Sort, argsort, topk, kthvalue, median, nanmedian and mode against PyTorch."""
import math

import pytest
import torch

import kiln
from kiln.graph import OperatorError
from tests.support import assert_close, rand

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
          torch.uint8]


def _distinct(shape, dtype):
    """Random values without ties (a random permutation, scaled), so indices are defined."""
    values = torch.randperm(math.prod(shape)).reshape(shape)
    values = values - (0 if dtype == torch.uint8 else math.prod(shape) // 2)
    return (values.to(torch.float64) / (1 if not dtype.is_floating_point else 3)).to(dtype)


@pytest.mark.parametrize("descending", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_sort_noncontiguous(dtype, descending):
    x = _distinct((5, 9, 3), dtype).transpose(0, 2)  # (3, 9, 5), non-contiguous
    values, indices = kiln.ops.sort(x, 1, descending)
    expected = torch.sort(x, dim=1, descending=descending, stable=True)
    assert_close(values, expected.values)
    assert_close(indices, expected.indices)
    assert_close(kiln.ops.argsort(x, 1, descending), expected.indices)


@pytest.mark.parametrize("descending", [False, True])
def test_sort_ties_are_stable_and_nan_orders_last(descending):
    x = rand((4, 11), torch.int32, low=-2, high=2).to(torch.float32)
    x[1, 3], x[2, 0], x[2, 7] = math.nan, math.nan, math.nan
    values, indices = kiln.ops.sort(x, -1, descending)
    expected = torch.sort(x, dim=-1, descending=descending, stable=True)
    assert_close(values, expected.values)
    assert_close(indices, expected.indices)


def test_sort_bool_and_0d():
    x = rand((3, 8), torch.bool)
    expected = torch.sort(x, dim=1, stable=True)
    assert_close(kiln.ops.sort(x, 1), tuple(expected))
    s = torch.tensor(2.5)
    assert_close(kiln.ops.sort(s), tuple(torch.sort(s)))


@pytest.mark.parametrize("largest", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int64])
def test_topk(dtype, largest):
    x = _distinct((6, 13), dtype).t()
    expected = torch.topk(x, 4, 0, largest)
    assert_close(kiln.ops.topk(x, 4, 0, largest), tuple(expected))


@pytest.mark.parametrize("keepdim", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32])
def test_kthvalue_and_median(dtype, keepdim):
    x = _distinct((7, 6), dtype).t()
    assert_close(kiln.ops.kthvalue(x, 3, 1, keepdim), tuple(torch.kthvalue(x, 3, 1, keepdim)))
    assert_close(kiln.ops.median(x, 1, keepdim), tuple(torch.median(x, 1, keepdim)))
    assert_close(kiln.ops.median(x, 0, keepdim), tuple(torch.median(x, 0, keepdim)))


def test_median_of_rows_with_nan():
    x = _distinct((5, 7), torch.float32)
    x[0, 4], x[2, 1], x[2, 5] = math.nan, math.nan, math.nan
    assert_close(kiln.ops.median(x, 1), tuple(torch.median(x, 1)))
    values, indices = kiln.ops.nanmedian(x, 1)
    expected = torch.nanmedian(x, 1)
    assert_close(values, expected.values)
    assert_close(indices, expected.indices)


def test_mode():
    x = rand((6, 15), torch.int64, low=0, high=4)
    assert_close(kiln.ops.mode(x, 1), tuple(torch.mode(x, 1)))
    y = rand((9, 4), torch.int32, low=-2, high=2).to(torch.float32)
    assert_close(kiln.ops.mode(y, 0, True), tuple(torch.mode(y, 0, True)))


def test_errors():
    x = rand((3, 4))
    with pytest.raises(OperatorError, match=r"topk: k=5 must be an int in \[0, 4\]"):
        kiln.ops.topk(x, 5)
    with pytest.raises(OperatorError, match=r"kthvalue: k=0 must be an int in \[1, 4\]"):
        kiln.ops.kthvalue(x, 0)
    with pytest.raises(OperatorError, match="sort: dim 2 is out of range"):
        kiln.ops.sort(x, 2)
