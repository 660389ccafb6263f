"""Indexing operators: slicing, padding, reading elements at positions held in index tensors
(embedding and embedding_bag among them), and triangular masks.

Index tensors are int64 or int32. Every loaded index is checked (`checked_index`): an index out
of range makes the kernel fail (IndexError, or RuntimeError where PyTorch raises that, on the
CPU; a trap on a GPU), and negative indices count from the end only where PyTorch accepts them
(`x[idx]`, take_along_dim along a dim). The index used is clamped too, so a kernel never reads
out of bounds even while it fails.
"""
from __future__ import annotations

import functools
import math

from kiln import dtypes
from kiln.ir.size import size_text
from kiln.graph import Layout, OperatorError, Role, Traits, operator
from kiln.ir import (Check, TensorNode, as_expr, cast, check, compute, eq, maximum, minimum, ne, reduce, select,
                     slice_extent, unravel)

from kiln_ops_builtin.common import broadcast_shape, in_bounds, normalize_dim
from kiln_ops_builtin.shape import dim_of, narrowed, reshaped

INDEX_TYPES = (dtypes.int64, dtypes.int32)


def _check_index(op: str, index: TensorNode, size: int, numel: int) -> None:
    """An index tensor must be integer, and must have somewhere to point if it is used."""
    if index.dtype not in INDEX_TYPES:
        raise OperatorError(f"{op}: index tensor must be int64 or int32, got {index.dtype}")
    if size == 0 and numel:
        raise OperatorError(f"{op}: cannot index a dim of size 0")


def checked_index(i, size: int, message: str, wrap: bool = False, error: str = "IndexError"):
    """Index expression `i` (any integer type) as an int64 in [0, size). With `wrap`, negative
    indices count from the end (down to -size). Any other index fails the kernel with `error`
    and `message` (where `{value}` shows the index); the value is clamped all the same."""
    raw = cast(i, dtypes.int64)
    i = select(raw < 0, raw + size, raw) if wrap else raw
    ok = (i >= 0) & (i < size)
    return check(ok, minimum(maximum(i, 0), size - 1), error, message, raw)


def _bounds_message(op: str, dim: int, size: int) -> str:
    return f"{op}: index {{value}} is out of bounds for dimension {dim} with size {size_text(size)}"


@operator("slice", traits=Traits(layout=Layout.ALONG_DIM))
def slice_(x, dim=0, start=None, end=None, step=1):
    """Elements start, start + step, ... before `end` of `x` along `dim`, with Python's slicing
    rules for negative and out-of-range bounds (`step` must be positive)."""
    d = dim_of("slice", dim, x)
    if not isinstance(step, int) or step <= 0:
        raise OperatorError(f"slice: step must be a positive int, got {step!r}")
    begin, count = slice_extent(start, end, step, x.shape[d])
    return narrowed(x, d, begin, count, step)


def _pad_source(mode: str, j, n: int):
    """The source position of padded position `j` (which may lie outside [0, n))."""
    if mode == "replicate":
        return minimum(maximum(j, 0), n - 1)
    j = select(j < 0, -j, j)  # reflect
    return select(j > n - 1, 2 * (n - 1) - j, j)


@operator("pad", traits=Traits(implements=Role.PAD))
def pad(x, pad, mode="constant", value=0):
    """`x` padded as torch.nn.functional.pad does: `pad` holds (before, after) pairs for the
    last dim first, then the one before it, ...; negative amounts crop. Modes: 'constant' (with
    `value`), 'reflect' (mirror without repeating the edge), 'replicate' (repeat the edge)."""
    if mode not in ("constant", "reflect", "replicate"):
        raise OperatorError(f"pad: mode must be 'constant', 'reflect' or 'replicate', got {mode!r}")
    if (not isinstance(pad, (list, tuple)) or len(pad) % 2 or len(pad) > 2 * x.ndim
            or not all(isinstance(p, int) for p in pad)):
        raise OperatorError(f"pad: pad must be an even number (at most {2 * x.ndim}) of ints for "
                            f"shape {x.shape}, got {pad!r}")
    before, after = [0] * x.ndim, [0] * x.ndim
    for k in range(len(pad) // 2):
        before[x.ndim - 1 - k], after[x.ndim - 1 - k] = pad[2 * k], pad[2 * k + 1]
    shape = [n + b + a for n, b, a in zip(x.shape, before, after)]
    for k, n in enumerate(x.shape):
        if shape[k] < 0:
            raise OperatorError(f"pad: padding {pad} gives a negative size in dim {k} of shape {x.shape}")
        if mode == "reflect" and max(before[k], after[k]) >= n and (before[k] or after[k]):
            raise OperatorError(f"pad: reflect padding ({before[k]}, {after[k]}) must be smaller "
                                f"than the size {n} of dim {k}")
        if mode == "replicate" and n == 0 and shape[k]:
            raise OperatorError(f"pad: replicate padding of dim {k} needs a non-empty dim, shape {x.shape}")
    fill = cast(0 if value is None else value, x.dtype)

    def element(*i):
        src = [i[k] - before[k] for k in range(x.ndim)]
        if mode != "constant":
            return x[[_pad_source(mode, j, n) if before[k] > 0 or after[k] > 0 else j
                      for k, (j, n) in enumerate(zip(src, x.shape))]]
        inside = in_bounds(src, x.shape)  # true where nothing is padded: simplification drops it
        return x[src] if inside is None else select(inside, x[src], fill)

    return compute(shape, element)


@operator("gather")
def gather(x, dim, index):
    """out[i] = x[i with i[dim] replaced by index[i]] (`index` has the rank of `x`, and no
    larger size than `x` outside `dim`)."""
    d = normalize_dim("gather", dim, x.ndim)
    if index.ndim != x.ndim or any(index.shape[k] > x.shape[k] for k in range(x.ndim) if k != d):
        raise OperatorError(f"gather: index of shape {index.shape} must have the rank of input shape "
                            f"{x.shape} and no larger size outside dim {dim}")
    _check_index("gather", index, x.shape[d] if x.ndim else 1, math.prod(index.shape))
    return _gathered(x, d, index, index.shape, lambda i, n: checked_index(
        i, n, _bounds_message("gather", d, n), error="RuntimeError"))


def _gathered(x: TensorNode, d: int, index: TensorNode, shape, position) -> TensorNode:
    """out[i] = x[i with i[d] replaced by position(index[i], size of dim d)], x and index read
    with broadcasting to `shape`."""
    def load(t, i):
        return t[[0 if t.shape[k] == 1 else i[k] for k in range(t.ndim)]]

    def scalar(*i):
        """x's only element, under the check of the index (which must point at it)."""
        p = position(load(index, i), 1)
        return Check(x[()], p.ok, p.error, p.message, p.reported)

    if x.ndim == 0:
        return compute(shape, scalar)
    return compute(shape, lambda *i: load(x, [position(load(index, i), x.shape[d]) if k == d else i[k]
                                              for k in range(x.ndim)]))


@operator("take_along_dim")
def take_along_dim(x, indices, dim=None):
    """Elements of `x` at `indices` along `dim`, the other dims broadcast (torch.take_along_dim;
    dim None: both flattened)."""
    if dim is None:
        n = math.prod(x.shape)
        _check_index("take_along_dim", indices, n, math.prod(indices.shape))
        return compute((math.prod(indices.shape),), lambda i: x[unravel(checked_index(
            indices[unravel(i, indices.shape)], n, _bounds_message("take_along_dim", 0, n),
            error="RuntimeError"), x.shape)])
    d = normalize_dim("take_along_dim", dim, x.ndim)
    if indices.ndim != x.ndim:
        raise OperatorError(f"take_along_dim: input of shape {x.shape} and indices of shape "
                            f"{indices.shape} must have the same number of dims")
    outer = broadcast_shape("take_along_dim", *[[1 if k == d else s for k, s in enumerate(t.shape)]
                                                 for t in (x, indices)])
    shape = [indices.shape[d] if k == d else s for k, s in enumerate(outer)]
    _check_index("take_along_dim", indices, x.shape[d] if x.ndim else 1, math.prod(shape))
    return _gathered(x, d, indices, shape, lambda i, n: checked_index(
        i, n, _bounds_message("take_along_dim", d, n), wrap=True))


@operator("index_select")
def index_select(x, dim, index):
    """The slices of `x` along `dim` at the positions in the 1-d (or 0-d) `index`."""
    d = normalize_dim("index_select", dim, x.ndim)
    if index.ndim > 1:
        raise OperatorError(f"index_select: index must be 1-d, got shape {index.shape}")
    count = math.prod(index.shape)
    shape = list(x.shape)
    if x.ndim:
        shape[d] = count
    _check_index("index_select", index, x.shape[d] if x.ndim else 1, math.prod(shape))
    positions = reshaped(index, [count if k == d else 1 for k in range(x.ndim)])
    return _gathered(x, d, positions, shape, lambda i, n: checked_index(
        i, n, f"index_select: index {{value}} is out of range for dimension {d} of size {size_text(n)}"))


@operator("embedding")
def embedding(input, weight):
    """Rows of the 2-d `weight` at the positions in `input` (torch.nn.functional.embedding)."""
    if weight.ndim != 2:
        raise OperatorError(f"embedding: weight must be 2-d, got shape {weight.shape}")
    shape = input.shape + weight.shape[1:]
    _check_index("embedding", input, weight.shape[0], math.prod(shape))
    rows = weight.shape[0]
    message = f"embedding: index {{value}} is out of range for a weight of {size_text(rows)} rows"
    return compute(shape, lambda *i: weight[checked_index(input[i[:-1]], rows, message), i[-1]])


@operator("one_hot")
def one_hot(input, num_classes: int):
    """int64 tensor of `input`'s shape and a last dim of `num_classes`: 1 at each element's
    value, 0 elsewhere (torch.nn.functional.one_hot); values outside [0, num_classes) fail."""
    if input.dtype != dtypes.int64:
        raise OperatorError(f"one_hot: input must be int64 (PyTorch's LongTensor), got {input.dtype}")
    if not isinstance(num_classes, int) or num_classes < 1:
        raise OperatorError(f"one_hot: num_classes must be a positive int here, got {num_classes!r} "
                            "(-1, the largest value plus one, gives a size known only from the data)")
    message = f"one_hot: class value {{value}} is not in [0, {num_classes})"
    return compute((*input.shape, num_classes), lambda *i: cast(
        eq(checked_index(input[i[:-1]], num_classes, message, error="RuntimeError"), i[-1]), dtypes.int64))


def _triangle(op: str, x: TensorNode, diagonal: int, keep) -> TensorNode:
    if x.ndim < 2:
        raise OperatorError(f"{op}: input must have at least 2 dims, got shape {x.shape}")
    if not isinstance(diagonal, int):
        raise OperatorError(f"{op}: diagonal must be an int, got {diagonal!r}")
    return compute(x.shape, lambda *i: select(keep(i[-1] - i[-2]), x[i], cast(0, x.dtype)))


@operator("tril")
def tril(x, diagonal=0):
    """`x` with the elements above diagonal `diagonal` of its last two dims set to zero."""
    return _triangle("tril", x, diagonal, lambda offset: offset <= diagonal)


@operator("triu")
def triu(x, diagonal=0):
    """`x` with the elements below diagonal `diagonal` of its last two dims set to zero."""
    return _triangle("triu", x, diagonal, lambda offset: offset >= diagonal)


@operator("wrap_index")
def wrap_index(index, size: int, dim: int = 0):
    """The int64 positions of `index` (int64 or int32) in a dim of `size`, negative ones counted
    from the end, as tensor indexing `x[index]` takes them; one out of [-size, size) makes the
    kernel fail with IndexError (naming `dim`)."""
    _check_index("wrap_index", index, size, math.prod(index.shape))
    message = f"index {{value}} is out of bounds for dimension {dim} with size {size_text(size)}"
    return compute(index.shape, lambda *i: checked_index(index[i], size, message, wrap=True))


EMBEDDING_BAG_MODES = ("sum", "mean", "max")


@operator("embedding_bag")
def embedding_bag(input, weight, offsets=None, mode="mean", per_sample_weights=None,
                  include_last_offset=False, padding_idx=None):
    """torch.nn.functional.embedding_bag without max_norm: rows of `weight` summed, averaged or
    maximized over each bag. A 2-d `input` holds one bag per row; a 1-d one is cut into bags at
    `offsets` (the last bag runs to the end, or `include_last_offset` ends it at the last
    offset). Entries equal to `padding_idx` are left out; an empty bag gives zeros."""
    op = "embedding_bag"
    if mode not in EMBEDDING_BAG_MODES:
        raise OperatorError(f"{op}: mode must be one of {EMBEDDING_BAG_MODES}, got {mode!r}")
    if weight.ndim != 2:
        raise OperatorError(f"{op}: weight must be 2-d, got shape {weight.shape}")
    if not weight.dtype.is_float:
        raise OperatorError(f"{op}: weight must be floating-point, got {weight.dtype}")
    rows, width = weight.shape
    _check_index(op, input, rows, math.prod(input.shape))
    if per_sample_weights is not None and (mode != "sum" or per_sample_weights.shape != input.shape):
        raise OperatorError(f"{op}: per_sample_weights (shape {per_sample_weights.shape}) need mode 'sum' and "
                            f"the input's shape {input.shape}")
    if padding_idx is not None:
        padding_idx = padding_idx + rows if padding_idx < 0 else padding_idx
    if input.ndim == 2:
        if offsets is not None:
            raise OperatorError(f"{op}: offsets must be None for a 2-d input, got shape {offsets.shape}")
        bags, length = input.shape
        entry = lambda b, j: input[b, j]
        in_bag = None
        weight_of = (lambda b, j: per_sample_weights[b, j]) if per_sample_weights is not None else None
    elif input.ndim == 1 and offsets is not None and offsets.ndim == 1:
        _check_index(op, offsets, input.shape[0] + 1, offsets.shape[0])
        length, count = input.shape[0], offsets.shape[0]
        bags = count - 1 if include_last_offset else count

        def in_bag(b, j):
            end = select(b + 1 < count, cast(offsets[minimum(b + 1, count - 1)], dtypes.int64), length)
            return (cast(offsets[b], dtypes.int64) <= j) & (j < end)

        entry = lambda b, j: input[j]
        weight_of = (lambda b, j: per_sample_weights[j]) if per_sample_weights is not None else None
    else:
        raise OperatorError(f"{op}: expected a 2-d input, or a 1-d input with 1-d offsets; got input "
                            f"{input.shape} and offsets {None if offsets is None else offsets.shape}")
    if bags < 0:
        raise OperatorError(f"{op}: include_last_offset needs at least one offset")
    acc = dtypes.float64 if weight.dtype == dtypes.float64 else dtypes.float32
    message = f"{op}: index {{value}} is out of range for a weight of {size_text(rows)} rows"

    def kept(b, j):
        conditions = ([] if in_bag is None else [in_bag(b, j)]) + \
            ([] if padding_idx is None else [ne(cast(entry(b, j), dtypes.int64), padding_idx)])
        return functools.reduce(lambda p, q: p & q, conditions, as_expr(True))

    def element(b, d):
        def value(j):
            v = cast(weight[checked_index(entry(b, j), rows, message), d], acc)
            return v * cast(weight_of(b, j), acc) if weight_of is not None else v

        members = reduce([length], lambda j: select(kept(b, j), 1, 0), dtype=dtypes.int64)
        if mode == "max":
            total = reduce([length], lambda j: select(kept(b, j), value(j), float("-inf")), op="max", dtype=acc)
            return select(members > 0, total, 0)
        total = reduce([length], lambda j: select(kept(b, j), value(j), 0), dtype=acc)
        return select(members > 0, total / cast(members, acc), 0) if mode == "mean" else total

    return compute((bags, width), element, dtype=weight.dtype)
