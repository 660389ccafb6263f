"""scatter, scatter_add, scatter_reduce, index_add, index_copy, index_fill, index_put and
masked_scatter against PyTorch."""
import math

import pytest
import torch

import kiln
from kiln.graph import OperatorError
from tests.support import assert_close, rand

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32]


def _unique_rows(n, shape):
    """An index of `shape` along dim 0 whose columns hold distinct positions < n."""
    return torch.stack([torch.randperm(n)[:shape[0]] for _ in range(shape[1])], 1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_scatter_and_scatter_add(dtype):
    x = rand((4, 7), dtype).t()  # (7, 4) non-contiguous
    src = rand((5, 4), dtype)
    index = _unique_rows(7, (3, 3))
    assert_close(kiln.ops.scatter(x, 0, index, src), x.scatter(0, index, src))
    assert_close(kiln.ops.scatter(x, 1, index.t() % 4, 2), x.scatter(1, index.t() % 4, 2))
    repeated = torch.randint(0, 7, (5, 4))
    tol = 2e-2 if dtype == torch.bfloat16 else None
    assert_close(kiln.ops.scatter_add(x, 0, repeated, src), x.scatter_add(0, repeated, src), tol, tol)


def test_scatter_duplicates_take_the_last():
    x = rand((6,))
    index = torch.tensor([1, 4, 1, 1, 0])
    src = rand((5,))
    assert_close(kiln.ops.scatter(x, 0, index, src), x.scatter(0, index, src))


@pytest.mark.parametrize("include_self", [True, False])
@pytest.mark.parametrize("reduce", ["sum", "prod", "mean", "amax", "amin"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int64])
def test_scatter_reduce(dtype, reduce, include_self):
    x = rand((5, 6), dtype, low=-3, high=3, nonzero=True)
    src = rand((4, 7), dtype, low=-3, high=3, nonzero=True)
    index = torch.randint(0, 6, (4, 3))
    tol = 5e-3 if dtype == torch.float16 else None
    assert_close(kiln.ops.scatter_reduce(x, 1, index, src, reduce, include_self),
                 x.scatter_reduce(1, index, src, reduce, include_self=include_self), tol, tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_index_add_copy_fill(dtype):
    x = rand((6, 5, 3), dtype)
    index = torch.tensor([4, 0, 2, 4, -1])
    source = rand((5, 6, 3), dtype).transpose(0, 1)  # (6, 5, 3), non-contiguous
    tol = 2e-2 if dtype == torch.bfloat16 else None
    assert_close(kiln.ops.index_add(x, 1, index.abs(), source, alpha=2),
                 x.index_add(1, index.abs(), source, alpha=2), tol, tol)
    distinct = torch.tensor([3, 0, 1])
    assert_close(kiln.ops.index_copy(x, 0, distinct, source[:3]), x.index_copy(0, distinct, source[:3]))
    assert_close(kiln.ops.index_fill(x, 2, torch.tensor([2, 0]), -1), x.index_fill(2, torch.tensor([2, 0]), -1))


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.bfloat16])
def test_index_put(dtype, accumulate):
    x = rand((5, 4, 3), dtype)
    rows, cols = torch.tensor([[0, -1], [2, 3]]), torch.tensor([1, 3])  # broadcast to (2, 2)
    values = rand((2, 2, 3), dtype)
    if not accumulate:
        rows = torch.tensor([[0, 4], [2, 3]])  # distinct positions: the written value is defined
    tol = 2e-2 if dtype == torch.bfloat16 else None
    assert_close(kiln.ops.index_put(x, [rows, cols], values, accumulate),
                 x.index_put((rows, cols), values, accumulate), tol, tol)
    repeated = torch.tensor([1, 1, 3])
    one = rand((3,), dtype)
    if accumulate:
        assert_close(kiln.ops.index_put(x, [repeated], one, True), x.index_put((repeated,), one, True), tol, tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.float16])
def test_masked_scatter(dtype):
    x = rand((4, 5), dtype).t()
    mask = rand((5, 1), torch.bool).expand(5, 4)
    source = rand((30,), dtype)
    assert_close(kiln.ops.masked_scatter(x, mask, source), x.masked_scatter(mask, source))


@pytest.mark.parametrize("x_shape, mask_shape", [((4, 5), (4, 1)), ((3, 4, 5), (3, 4, 1)), ((6, 5), (6, 5))])
def test_masked_scatter_from_a_source_of_several_dims(x_shape, mask_shape):
    """A source read at an index unravelled from one count of the mask, once per dim: the
    count's copies in the index expressions keep one reduction axis (`kiln.ir.substitute`)."""
    x = rand(x_shape)
    mask = rand(mask_shape, torch.bool)
    source = rand((x_shape[0], math.prod(x_shape[1:])))
    assert_close(kiln.ops.masked_scatter(x, mask, source), x.masked_scatter(mask, source))


def test_errors():
    x = rand((4, 5))
    with pytest.raises(OperatorError, match="scatter: index must be int64 or int32"):
        kiln.ops.scatter(x, 0, rand((2, 5)), rand((2, 5)))
    with pytest.raises(OperatorError, match="scatter_reduce: reduce must be one of"):
        kiln.ops.scatter_reduce(x, 0, torch.zeros(2, 5, dtype=torch.int64), rand((2, 5)), "median")
    with pytest.raises(OperatorError, match="index_add: source of shape"):
        kiln.ops.index_add(x, 0, torch.tensor([0, 1]), rand((3, 5)))
    with pytest.raises(OperatorError, match="masked_scatter: mask must be bool"):
        kiln.ops.masked_scatter(x, x, rand((20,)))


@pytest.mark.parametrize("include_self", [True, False])
@pytest.mark.parametrize("reduce", ["prod", "mean", "amax", "amin"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
def test_index_reduce(dtype, reduce, include_self):
    x = rand((4, 6), dtype, nonzero=True)
    source = rand((4, 5), dtype, nonzero=True)
    index = torch.tensor([5, 0, 5, 2, 0])
    assert_close(kiln.ops.index_reduce(x, 1, index, source, reduce, include_self),
                 x.index_reduce(1, index, source, reduce, include_self=include_self))


@pytest.mark.parametrize("bad", [3, -4, 100])
def test_out_of_range_indices_fail_instead_of_matching_nothing(bad):
    """An index outside [-size, size) raises (it used to be dropped silently)."""
    from kiln.runtime.kernel_errors import KernelIndexError
    x, src = kiln.from_torch(torch.randn(3, 4)), kiln.from_torch(torch.randn(2, 4))
    index = kiln.from_torch(torch.tensor([[0, 1, 2, 0], [1, bad, 0, 2]]))
    row = kiln.from_torch(torch.tensor([0, bad]))
    calls = {
        "scatter": lambda: kiln.ops.scatter(x, 0, index, src),
        "scatter_add": lambda: kiln.ops.scatter_add(x, 0, index, src),
        "index_add": lambda: kiln.ops.index_add(x, 0, row, src),
        "index_fill": lambda: kiln.ops.index_fill(x, 0, row, 1.5),
        "index_put": lambda: kiln.ops.index_put(x, [row], kiln.from_torch(torch.randn(4))),
    }
    for name, call in calls.items():
        with pytest.raises(KernelIndexError, match=f"{name}: index {bad} is out of bounds for dimension 0 with size 3"):
            call().torch()
