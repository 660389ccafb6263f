"""Shape and layout operators against PyTorch."""
import re

import pytest
import torch

import kiln
from kiln import ops
from kiln.graph import OperatorError
from tests.support import assert_close, rand

f16, bf16, f32, f64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
i32, i64, u8, b = torch.int32, torch.int64, torch.uint8, torch.bool


def strided(shape, dtype):
    """Fresh random values of `shape` in a non-contiguous layout (reversed dims, or every
    other element for one dim)."""
    if len(shape) < 2:
        return rand([2 * s for s in shape], dtype)[::2] if shape else rand(shape, dtype)
    return rand(shape[::-1], dtype).permute(*reversed(range(len(shape))))


# (kiln op, torch function, input shape (a list of shapes: a list of tensors), dtype, arguments)
CASES = [
    ("reshape", torch.reshape, (2, 3, 4), f32, ((4, -1),)),
    ("reshape", torch.reshape, (6, 2), i64, ([3, 2, 2, 1],)),
    ("reshape", torch.reshape, (), bf16, ((1, 1),)),
    ("reshape", torch.reshape, (3, 0, 2), f32, ((2, -1),)),
    ("squeeze", torch.squeeze, (1, 3, 1, 2), f16, ()),
    ("squeeze", torch.squeeze, (1, 3, 1, 2), u8, (-2,)),
    ("squeeze", torch.squeeze, (1, 3, 1, 2), b, ((0, 1),)),
    ("unsqueeze", torch.unsqueeze, (3, 4), i32, (1,)),
    ("unsqueeze", torch.unsqueeze, (3, 4), bf16, (-1,)),
    ("flatten", torch.flatten, (2, 3, 4), f32, ()),
    ("flatten", torch.flatten, (2, 3, 4, 2), i64, (1, -2)),
    ("flatten", torch.flatten, (), f32, ()),
    ("permute", torch.permute, (2, 3, 4), f16, ((2, 0, 1),)),
    ("permute", torch.permute, (2, 3, 4), b, ([-1, 1, 0],)),
    ("transpose", torch.transpose, (), i32, (0, -1)),
    ("transpose", torch.transpose, (2, 3, 4), u8, (0, -1)),
    ("expand", torch.Tensor.expand, (1, 5, 1), f32, ((2, 3, -1, 4),)),
    ("broadcast_to", torch.broadcast_to, (4,), bf16, ((3, 4),)),
    ("flip", torch.flip, (2, 3, 4), i32, ((0, -1),)),
    ("flip", torch.Tensor.flip, (3, 5), f16, (1,)),
    ("roll", torch.roll, (2, 3, 4), f32, ((1, -7), (0, 2))),
    ("roll", torch.roll, (2, 3), i64, ((2, 3), (1, 1))),
    ("roll", torch.roll, (3, 4), b, (5,)),
    ("repeat", torch.Tensor.repeat, (3, 2), f32, ((2, 1, 3),)),
    ("repeat", torch.Tensor.repeat, (3, 2), f32, ((2, 0),)),
    ("tile", torch.tile, (2, 3), u8, ((2,),)),
    ("tile", torch.tile, (2, 3), bf16, ((2, 1, 2),)),
    ("concat", torch.cat, [(2, 3, 4), (2, 1, 4)], f32, (1,)),
    ("cat", torch.cat, [(3, 2), (3, 4), (3, 1)], i32, (-1,)),
    ("cat", torch.cat, [(0, 3), (2, 3)], f16, ()),
    ("cat", torch.cat, [(2, 3), (0,)], f32, ()),
    ("stack", torch.stack, [(2, 3), (2, 3)], b, ()),
    ("stack", torch.stack, [(), ()], f16, ()),
    ("stack", torch.stack, [(2, 3), (2, 3), (2, 3)], i64, (-1,)),
    ("split", torch.split, (3, 5), f32, (2, -1)),
    ("split", torch.split, (4, 3), bf16, ([1, 0, 3],)),
    ("chunk", torch.chunk, (2, 7), u8, (3, 1)),
    ("chunk", torch.chunk, (6, 2), i32, (4,)),
]


@pytest.mark.parametrize("layout", ["contiguous", "strided"])
@pytest.mark.parametrize("op, ref, shape, dtype, args", [pytest.param(*c, id=c[0]) for c in CASES])
def test_matches_torch(op, ref, shape, dtype, args, layout):
    make = rand if layout == "contiguous" else strided
    x = [make(s, dtype) for s in shape] if isinstance(shape, list) else make(shape, dtype)
    assert_close(getattr(ops, op)(x, *args), ref(x, *args))


@pytest.mark.parametrize("dtypes, shapes, dim", [
    ((f32, f16), [(2, 3), (2, 4)], 1),
    ((i32, u8, b), [(2, 2), (1, 2), (3, 2)], 0),
    ((bf16, i64), [(3,), (2,)], 0),
])
def test_concat_and_stack_promote(dtypes, shapes, dim):
    xs = [rand(s, t) for s, t in zip(shapes, dtypes)]
    assert_close(ops.concat(xs, dim), torch.cat(xs, dim))
    ys = [rand(shapes[0], t) for t in dtypes]
    assert_close(ops.stack(ys, dim), torch.stack(ys, dim))


def test_cat_of_many_tensors():
    xs = [strided((3, k % 3 + 1), bf16) for k in range(7)]
    assert_close(ops.cat(xs, -1), torch.cat(xs, -1))


def test_cat_promotes_with_skipped_legacy_empty_tensors():
    xs = [rand((2, 3), i32), torch.empty(0, dtype=f16)]
    assert_close(ops.cat(xs), torch.cat(xs))


def test_split_of_empty_dim_gives_one_piece():
    x = rand((0, 3))
    assert_close(ops.split(x, 2), x.split(2)[0])


def test_chunk_of_empty_dim_gives_every_piece():
    x = rand((0, 3))
    assert_close(ops.chunk(x, 3), x.chunk(3))


def test_traced_graph_runs():
    s = kiln.symbol((2, 3, 4))
    a, b = ops.split(ops.transpose(ops.reshape(s, (4, 6)), 0, 1), [2, 4], 0)
    graph = kiln.trace_from([ops.flatten(a), b])
    x = rand((2, 3, 4))
    a, b = x.reshape(4, 6).transpose(0, 1).split([2, 4], 0)
    assert_close(graph(x), (a.flatten(), b))


# (input shape, size, stride, storage offset) of views of a row-major storage
STRIDED_VIEWS = [
    ((3, 4, 5), (2, 3), (1, 4), 1),             # a slice, dims swapped
    ((3, 4, 5), (4, 5, 3), (5, 1, 20), 0),      # a permutation
    ((3, 4, 5), (2, 2, 2), (30, 1, 10), 3),     # steps in every dim
    ((3, 4), (1, 4), (100, 1), 4),              # a size-1 dim's stride does not matter
    ((3, 4), (), (), 5),                        # one element
    ((3, 4), (0, 3), (1, 1), 0),                # no elements
]


@pytest.mark.parametrize("dtype", [f32, bf16, i64])
@pytest.mark.parametrize("shape, size, stride, offset", STRIDED_VIEWS + [
    ((3, 4, 5), (6, 7), (3, 2), 7),             # overlapping windows
    ((3, 4), (3, 2), (0, 1), 2),                # an expanded row
])
def test_as_strided_views_the_row_major_storage(shape, size, stride, offset, dtype):
    x = strided(shape, dtype)
    assert_close(ops.as_strided(x, size, stride, offset), x.contiguous().as_strided(size, stride, offset))


@pytest.mark.parametrize("dtype", [f32, f16, i32])
@pytest.mark.parametrize("shape, size, stride, offset", STRIDED_VIEWS)
def test_as_strided_scatter_writes_the_row_major_storage(shape, size, stride, offset, dtype):
    x, src = strided(shape, dtype), strided(size, dtype)
    assert_close(ops.as_strided_scatter(x, src, size, stride, offset),
                 torch.as_strided_scatter(x.contiguous(), src, size, stride, offset))


@pytest.mark.parametrize("call, message", [
    (lambda x: ops.reshape(x, (5, -1)), "reshape: shape (5, -1) is invalid for an input of 24"),
    (lambda x: ops.reshape(x, (-1, -1)), "reshape: invalid shape"),
    (lambda x: ops.reshape(x, (2, 3, 5)), "reshape: shape (2, 3, 5) is invalid"),
    (lambda x: ops.squeeze(x, 3), "squeeze: dim 3 is out of range for a tensor of rank 3"),
    (lambda x: ops.unsqueeze(x, 4), "unsqueeze: dim 4 is out of range"),
    (lambda x: ops.flatten(x, 2, 1), "flatten: start_dim 2 comes after end_dim 1"),
    (lambda x: ops.permute(x, (0, 1)), "permute: dims (0, 1) must order all 3 dims"),
    (lambda x: ops.permute(x, (0, 1, 1)), "permute: dims (0, 1, 1) name a dimension more than once"),
    (lambda x: ops.transpose(x, 0, -4), "transpose: dim -4 is out of range"),
    (lambda x: ops.expand(x, (3, 3, 4)), "expand: cannot expand shape (2, 3, 4) to (3, 3, 4)"),
    (lambda x: ops.expand(x, (3, 4)), "expand: cannot expand shape (2, 3, 4) to 2 dims"),
    (lambda x: ops.broadcast_to(x, (-1, 2, 3, 4)), "broadcast_to: cannot expand"),
    (lambda x: ops.flip(x, (0, -3)), "flip: dims (0, -3) name a dimension more than once"),
    (lambda x: ops.roll(x, (1, 2)), "roll: without dims, shifts must be one int"),
    (lambda x: ops.roll(x, (1, 2), 0), "roll: shifts [1, 2] and dims [0] must have the same length"),
    (lambda x: ops.repeat(x, (2, 2)), "repeat: repeats (2, 2) must be non-negative, at least one per dim"),
    (lambda x: ops.tile(x, (2, -1)), "tile: repeats (1, 2, -1) must be non-negative"),
    (lambda x: ops.concat([x, rand((2, 4, 4))], 0),
     "concat: shapes (2, 3, 4), (2, 4, 4) must match except in dim 0"),
    (lambda x: ops.cat([x, rand((2, 3))], 1), "cat: shapes (2, 3, 4), (2, 3) must match"),
    (lambda x: ops.concat([], 0), "concat: expected a non-empty list of tensors"),
    (lambda x: ops.cat([x[0, 0, 0], x[0, 0, 1]]), "cat: 0-d tensors cannot be joined along a dim"),
    (lambda x: ops.stack([x, rand((2, 3, 5))]), "stack: all tensors must have one shape"),
    (lambda x: ops.stack([x, x], 4), "stack: dim 4 is out of range for a tensor of rank 4"),
    (lambda x: ops.split(x, [1, 1], 1), "split: sizes [1, 1] must be non-negative and sum to 3"),
    (lambda x: ops.split(x, 0), "split: split size must be positive"),
    (lambda x: ops.split(x[0, 0, 0], 1), "split: expected a tensor with at least one dim, got a 0-d tensor"),
    (lambda x: ops.chunk(x, 0), "chunk: chunks must be a positive int"),
    (lambda x: ops.as_strided(x, (3, 5), (20, 1), 30),
     "as_strided: size (3, 5), stride (20, 1) and storage offset 30 do not describe a view of the "
     "24 elements of a float32 tensor of shape (2, 3, 4)"),
    (lambda x: ops.as_strided(x, (2, 3), (1,), 0), "as_strided: size (2, 3), stride (1,)"),
    (lambda x: ops.as_strided_scatter(x, rand((3, 2)), (3, 2), (0, 1), 2),
     "as_strided_scatter: size (3, 2) and stride (0, 1) describe a view whose elements overlap"),
    (lambda x: ops.as_strided_scatter(x, rand((4, 2)), (4, 2), (2, 5), 0),   # distinct, not nested
     "as_strided_scatter: size (4, 2) and stride (2, 5) describe a view whose elements overlap"),
    (lambda x: ops.as_strided_scatter(x, rand((2, 2)), (2, 3), (3, 1), 0),
     "as_strided_scatter: src of shape (2, 2) must have the view's size (2, 3)"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_bad_input_names_the_operator(call, message):
    with pytest.raises(OperatorError, match=re.escape(message)):
        call(rand((2, 3, 4)))
