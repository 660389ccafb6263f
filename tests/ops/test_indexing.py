"""Slicing, padding, index-tensor and triangular operators against PyTorch."""
import re

import pytest
import torch
import torch.nn.functional as F

from kiln import ops
from kiln.graph import OperatorError
from tests.support import assert_close, rand

f16, bf16, f32, f64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
i32, i64, u8, b = torch.int32, torch.int64, torch.uint8, torch.bool


def strided(shape, dtype):
    """Fresh random values of `shape` in a non-contiguous layout."""
    if len(shape) < 2:
        return rand([2 * s for s in shape], dtype)[::2] if shape else rand(shape, dtype)
    return rand(shape[::-1], dtype).permute(*reversed(range(len(shape))))


def index(shape, high, dtype=i64):
    """Random positions in [0, high)."""
    return torch.randint(0, high, shape).to(dtype)


@pytest.mark.parametrize("dim, start, end, step", [
    (0, 1, 3, 1), (1, -4, None, 2), (-1, None, -1, 3), (2, -100, 100, 1), (1, 4, 2, 1), (0, 7, None, 1),
])
@pytest.mark.parametrize("dtype, make", [(f32, rand), (bf16, strided), (i64, strided), (b, rand)])
def test_slice(dim, start, end, step, dtype, make):
    x = make((4, 6, 5), dtype)
    ref = x[tuple([slice(None)] * (dim % 3) + [slice(start, end, step)])]
    assert_close(ops.slice(x, dim, start, end, step), ref)


@pytest.mark.parametrize("pad, mode, value", [
    ((1, 2), "constant", 0.0), ((2, 0, 1, 3), "constant", -1.5), ((-1, 2, 0, 1, 1, 0), "constant", 2.0),
    ((2, 3), "reflect", None), ((1, 2, 3, 1), "reflect", None), ((3, 1, 0, 2), "replicate", None),
    ((1, 1, 2, 0), "replicate", None),
])
@pytest.mark.parametrize("dtype, make", [(f32, strided), (f16, rand), (i32, rand)])
def test_pad(pad, mode, value, dtype, make):
    x = make((2, 4, 5), dtype)
    kwargs = {} if value is None else {"value": value}
    assert_close(ops.pad(x, pad, mode, **kwargs), F.pad(x, pad, mode, **kwargs))


@pytest.mark.parametrize("dtype", [u8, b, bf16])
def test_pad_constant_types(dtype):
    x = rand((3, 4), dtype)
    assert_close(ops.pad(x, (1, 1, 2, 0), value=1), F.pad(x, (1, 1, 2, 0), value=1))


@pytest.mark.parametrize("dim, index_shape, index_dtype", [
    (0, (3, 4, 2), i64), (1, (2, 5, 1), i32), (-1, (2, 4, 7), i64), (2, (1, 1, 1), i64),
])
@pytest.mark.parametrize("dtype", [f32, f16, i64])
def test_gather(dim, index_shape, index_dtype, dtype):
    x = strided((3, 4, 5), dtype)
    idx = index(index_shape, x.shape[dim], index_dtype)
    assert_close(ops.gather(x, dim, idx), torch.gather(x, dim, idx))


def test_gather_strided_index():
    x = rand((4, 6), bf16)
    idx = index((6, 4), 6).t()
    assert_close(ops.gather(x, 1, idx), torch.gather(x, 1, idx))


@pytest.mark.parametrize("dim, idx", [
    (0, index((5,), 4)), (1, index((3,), 6, i32)), (-1, index((), 5)), (2, index((0,), 5)),
])
@pytest.mark.parametrize("dtype, make", [(f32, rand), (bf16, strided), (u8, rand), (b, strided)])
def test_index_select(dim, idx, dtype, make):
    x = make((4, 6, 5), dtype)
    assert_close(ops.index_select(x, dim, idx), torch.index_select(x, dim, idx))


@pytest.mark.parametrize("x_shape, idx_shape, dim", [
    ((3, 4), (3, 2), 1), ((3, 1, 5), (1, 4, 2), -1), ((4, 5), (6, 1), 0), ((3, 4), (2, 5), None),
])
@pytest.mark.parametrize("dtype", [f32, i32])
def test_take_along_dim(x_shape, idx_shape, dim, dtype):
    x = strided(x_shape, dtype)
    high = x.numel() if dim is None else x_shape[dim]
    idx = index(idx_shape, high)
    # torch flattens with view() for dim=None, which a strided input refuses
    assert_close(ops.take_along_dim(x, idx, dim), torch.take_along_dim(x.contiguous(), idx, dim))


@pytest.mark.parametrize("idx_shape, idx_dtype", [((3, 4), i64), ((5,), i32), ((), i64)])
@pytest.mark.parametrize("dtype", [f32, f16, bf16])
def test_embedding(idx_shape, idx_dtype, dtype):
    weight = strided((7, 6), dtype)
    idx = index(idx_shape, 7, idx_dtype)
    assert_close(ops.embedding(idx, weight), F.embedding(idx, weight))


@pytest.mark.parametrize("shape, diagonal", [((4, 4), 0), ((3, 5), 1), ((2, 5, 3), -1), ((2, 3), 7)])
@pytest.mark.parametrize("dtype, make", [(f32, strided), (f16, rand), (i64, rand), (b, strided)])
def test_tril_triu(shape, diagonal, dtype, make):
    x = make(shape, dtype)
    assert_close(ops.tril(x, diagonal), torch.tril(x, diagonal))
    assert_close(ops.triu(x, diagonal), torch.triu(x, diagonal))


def test_out_of_range_indices_raise_instead_of_being_clamped():
    x = rand((4, 3))
    for idx in (torch.tensor([-5, 1]), torch.tensor([1, 99])):
        with pytest.raises(IndexError, match="index_select: index (-5|99) is out of range"):
            ops.index_select(x, 0, idx)
        with pytest.raises(IndexError, match="embedding: index (-5|99) is out of range"):
            ops.embedding(idx, x)
    for idx in (torch.tensor([[7], [0], [2], [1]]), torch.tensor([[0], [-1], [2], [1]])):
        with pytest.raises(RuntimeError, match="gather: index (7|-1) is out of bounds for dimension 1 with size 3"):
            ops.gather(x, 1, idx)


@pytest.mark.parametrize("call, message", [
    (lambda x: ops.slice(x, 3), "slice: dim 3 is out of range for a tensor of rank 3"),
    (lambda x: ops.slice(x[0, 0, 0]), "slice: expected a tensor with at least one dim, got a 0-d tensor"),
    (lambda x: ops.slice(x, 0, 0, 2, 0), "slice: step must be a positive int, got 0"),
    (lambda x: ops.slice(x, 0, 2, 0, -1), "slice: step must be a positive int, got -1"),
    (lambda x: ops.pad(x, (1,)), "pad: pad must be an even number (at most 6) of ints"),
    (lambda x: ops.pad(x, (1, 1) * 4), "pad: pad must be an even number (at most 6) of ints"),
    (lambda x: ops.pad(x, (1, 1), "circular"), "pad: mode must be 'constant', 'reflect' or 'replicate'"),
    (lambda x: ops.pad(x, (0, 4), "reflect"), "pad: reflect padding (0, 4) must be smaller than the size 4"),
    (lambda x: ops.pad(x, (-3, -2)), "pad: padding (-3, -2) gives a negative size in dim 2"),
    (lambda x: ops.gather(x, 1, index((2, 3), 3)), "gather: index of shape (2, 3) must have the rank"),
    (lambda x: ops.gather(x, 0, index((2, 4, 4), 2)), "gather: index of shape (2, 4, 4) must have the rank"),
    (lambda x: ops.gather(x, 0, rand((2, 3, 4))), "gather: index tensor must be int64 or int32, got float32"),
    (lambda x: ops.index_select(x, 1, index((2, 2), 3)), "index_select: index must be 1-d"),
    (lambda x: ops.index_select(x, 1, index((2,), 3, torch.int16)),
     "index_select: index tensor must be int64 or int32, got int16"),
    (lambda x: ops.index_select(x[:, :0], 1, index((2,), 3)), "index_select: cannot index a dim of size 0"),
    (lambda x: ops.take_along_dim(x, index((2, 3), 3), 1),
     "take_along_dim: input of shape (2, 3, 4) and indices of shape (2, 3) must have the same number"),
    (lambda x: ops.take_along_dim(x, index((3, 1, 1), 3), 1),
     "take_along_dim: shapes (2, 1, 4) and (3, 1, 1) cannot be broadcast"),
    (lambda x: ops.embedding(index((3,), 2), x), "embedding: weight must be 2-d, got shape (2, 3, 4)"),
    (lambda x: ops.embedding(x[0].to(torch.float16), x[0]), "embedding: index tensor must be int64 or int32"),
    (lambda x: ops.tril(x[0, 0]), "tril: input must have at least 2 dims, got shape (4,)"),
    (lambda x: ops.triu(x, 0.5), "triu: diagonal must be an int"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_bad_input_names_the_operator(call, message):
    with pytest.raises(OperatorError, match=re.escape(message)):
        call(rand((2, 3, 4)))
