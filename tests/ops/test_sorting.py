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


COMPUTED = {
    "topk": lambda y: torch.topk(y, 8, dim=-1)[1],
    "topk_unsorted": lambda y: torch.topk(y, 8, dim=-1, sorted=False)[1],
    "argsort": lambda y: torch.argsort(y, dim=-1, stable=True),
    "sort": lambda y: torch.sort(y, dim=-1, stable=True)[1],
    "kthvalue": lambda y: torch.kthvalue(y, 5, dim=-1)[1],
    "median": lambda y: torch.median(y, dim=-1)[1],
    "mode": lambda y: torch.mode(torch.round(y * 8), dim=-1)[1],
}


@pytest.mark.parametrize("op", COMPUTED)
@pytest.mark.parametrize("rows", [4, 34])
def test_ranks_of_a_computed_input_see_one_value_per_element(op, rows):
    """Before: `torch.topk(torch.sigmoid(x) * 1.0, 8)` (a mixture-of-experts router, HY-V3's)
    gave positions up to 252 in rows of 192 on the CPU, silently. Fusion put the sigmoid in the
    ranking kernel, which read each element both from a temporary its vectorized loop wrote and
    from its own scalar evaluation; the two differed in the last bit, two elements took one
    rank, and the position of a rank summed theirs. The input of an operator that
    `compares_elements` is now computed apart. Checked: positions in range and distinct, and
    in order of the values eager computes at them (within a rounding step)."""
    torch.manual_seed(0)
    x = torch.randn(rows, 192) * 3
    fn = lambda x: COMPUTED[op](torch.sigmoid(x) * 1.0)  # noqa: E731
    torch._dynamo.reset()
    got = torch.compile(fn, backend="kiln")(x)
    y = torch.sigmoid(x)
    assert got.min() >= 0 and got.max() < 192
    if op in ("kthvalue", "median", "mode"):
        want = fn(x)
        chosen, expected = y.gather(1, got[:, None]), y.gather(1, want[:, None])
        key = torch.round(y * 8) if op == "mode" else y
        assert torch.equal(key.gather(1, got[:, None]), key.gather(1, want[:, None])) or \
            torch.allclose(chosen, expected, atol=1e-6, rtol=0)
        return
    assert all(len(set(row.tolist())) == len(row) for row in got), "a position taken twice"
    values = y.gather(1, got)
    steps = values[:, 1:] - values[:, :-1]
    if op in ("argsort", "sort"):
        assert (steps >= -1e-6).all()
    if op == "topk":
        assert (steps <= 1e-6).all()
    if op.startswith("topk"):
        top = torch.topk(y, 8, dim=-1).values
        torch.testing.assert_close(values.sort(-1).values, top.sort(-1).values, atol=1e-6, rtol=0)
