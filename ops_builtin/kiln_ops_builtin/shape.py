"""Shape and layout operators: views of a tensor's elements in another shape or order, and
joining and splitting tensors. Each is a copy kernel; graph passes remove the copies later."""
from __future__ import annotations

import math

from kiln import dtypes
from kiln.graph import Layout, OperatorError, Role, Traits, operator
from kiln.ir import TensorNode, as_expr, as_index, cast, compute, eq, select, unravel

from kiln_ops_builtin.common import clamp_index, normalize_dim, ravel, result_type


def _ints(op: str, what: str, values) -> list[int]:
    """`values` (an int or a sequence of ints, any type with __index__) as a list of ints."""
    values = list(values) if isinstance(values, (list, tuple)) else [values]
    if not all(hasattr(type(v), "__index__") and not isinstance(v, bool) for v in values):
        raise OperatorError(f"{op}: {what} must be an int or a sequence of ints, got {values!r}")
    return [as_index(v) for v in values]


def _dims(op: str, dims, ndim: int) -> list[int]:
    """Distinct dims counted from 0."""
    out = [normalize_dim(op, d, ndim) for d in _ints(op, "dims", dims)]
    if len(set(out)) != len(out):
        raise OperatorError(f"{op}: dims {dims} name a dimension more than once")
    return out


def dim_of(op: str, dim, x: TensorNode) -> int:
    """`dim` of `x` counted from 0, for operators that need a tensor with dims."""
    if x.ndim == 0:
        raise OperatorError(f"{op}: expected a tensor with at least one dim, got a 0-d tensor")
    return normalize_dim(op, dim, x.ndim)


def reshaped(x: TensorNode, shape) -> TensorNode:
    """The elements of `x` in row-major order, in `shape` (of the same number of elements)."""
    return compute(shape, lambda *i: x[unravel(ravel(i, shape), x.shape)])


def infer_shape(op: str, shape, numel: int) -> tuple[int, ...]:
    """`shape` with its one -1 (if any) resolved so that it holds `numel` elements."""
    shape = _ints(op, "shape", shape)
    free = [k for k, s in enumerate(shape) if s == -1]
    if len(free) > 1 or any(s < -1 for s in shape):
        raise OperatorError(f"{op}: invalid shape {tuple(shape)}: at most one -1 and no other negative size")
    known = math.prod(s for s in shape if s != -1)
    if free:
        if known == 0 or numel % known:
            raise OperatorError(f"{op}: shape {tuple(shape)} is invalid for an input of {numel} elements")
        shape[free[0]] = numel // known
    if math.prod(shape) != numel:
        raise OperatorError(f"{op}: shape {tuple(shape)} is invalid for an input of {numel} elements")
    return tuple(shape)


@operator("reshape", traits=Traits(implements=Role.RESHAPE, view=True))
def reshape(x, shape):
    """`x` in `shape` (one size may be -1: inferred)."""
    return reshaped(x, infer_shape("reshape", shape, math.prod(x.shape)))


@operator("squeeze", traits=Traits(view=True))
def squeeze(x, dim=None):
    """`x` without the size-1 dims among `dim` (an int, a tuple, or None: all dims)."""
    dims = range(x.ndim) if dim is None else _dims("squeeze", dim, x.ndim)
    drop = {d for d in dims if x.ndim and x.shape[d] == 1}
    return reshaped(x, [s for k, s in enumerate(x.shape) if k not in drop])


@operator("unsqueeze", traits=Traits(view=True))
def unsqueeze(x, dim):
    """`x` with a new dim of size 1 at position `dim`."""
    d = normalize_dim("unsqueeze", dim, x.ndim + 1)
    return reshaped(x, x.shape[:d] + (1,) + x.shape[d:])


@operator("flatten", traits=Traits(view=True))
def flatten(x, start_dim=0, end_dim=-1):
    """`x` with dims `start_dim` to `end_dim` merged into one."""
    start = normalize_dim("flatten", start_dim, x.ndim)
    end = normalize_dim("flatten", end_dim, x.ndim)
    if start > end:
        raise OperatorError(f"flatten: start_dim {start_dim} comes after end_dim {end_dim}")
    if x.ndim == 0:
        return reshaped(x, (1,))
    return reshaped(x, x.shape[:start] + (math.prod(x.shape[start:end + 1]),) + x.shape[end + 1:])


def _permuted(x: TensorNode, order: list[int]) -> TensorNode:
    """`x` with output dim k taken from input dim `order[k]`."""
    inverse = [order.index(k) for k in range(x.ndim)]
    return compute([x.shape[d] for d in order], lambda *i: x[[i[k] for k in inverse]])


def _permute_order(node) -> list[int]:
    """The order a permute node applies (its `permutation` trait)."""
    return [d % node.inputs[0].ndim for d in node.attrs["dims"]]


def _transpose_order(node) -> list[int]:
    """The order a transpose node applies (its `permutation` trait)."""
    n = node.inputs[0].ndim
    order = list(range(n))
    a, b = node.attrs["dim0"] % n, node.attrs["dim1"] % n
    order[a], order[b] = b, a
    return order


@operator("permute", traits=Traits(implements=Role.PERMUTE, permutation=_permute_order))
def permute(x, dims):
    """`x` with its dims reordered: output dim k is input dim `dims[k]`."""
    order = _dims("permute", dims, x.ndim)
    if len(order) != x.ndim:
        raise OperatorError(f"permute: dims {tuple(dims)} must order all {x.ndim} dims of shape {x.shape}")
    return _permuted(x, order)


@operator("transpose", traits=Traits(permutation=_transpose_order))
def transpose(x, dim0, dim1):
    """`x` with dims `dim0` and `dim1` swapped."""
    a, b = normalize_dim("transpose", dim0, x.ndim), normalize_dim("transpose", dim1, x.ndim)
    order = list(range(x.ndim))
    if x.ndim:
        order[a], order[b] = b, a
    return _permuted(x, order)


def _expanded(op: str, x: TensorNode, sizes) -> TensorNode:
    sizes = _ints(op, "sizes", sizes)
    lead = len(sizes) - x.ndim
    if lead < 0:
        raise OperatorError(f"{op}: cannot expand shape {x.shape} to {len(sizes)} dims {tuple(sizes)}")
    shape = []
    for k, s in enumerate(sizes):
        have = x.shape[k - lead] if k >= lead else None
        if s == -1 and have is not None:
            s = have
        if s < 0 or (have is not None and have not in (1, s)):
            raise OperatorError(f"{op}: cannot expand shape {x.shape} to {tuple(sizes)} "
                                f"(dim {k}: size {have} to {s}; only size-1 dims expand, -1 keeps a size)")
        shape.append(s)
    return compute(shape, lambda *i: x[[0 if x.shape[k] == 1 else i[k + lead] for k in range(x.ndim)]])


@operator("expand")
def expand(x, sizes):
    """`x` broadcast to `sizes` (new dims lead; -1 keeps a dim's size)."""
    return _expanded("expand", x, sizes)


@operator("broadcast_to")
def broadcast_to(x, shape):
    """`x` broadcast to `shape`."""
    return _expanded("broadcast_to", x, shape)


@operator("flip")
def flip(x, dims):
    """`x` with the order of elements along `dims` reversed."""
    flipped = set(_dims("flip", dims, x.ndim))
    return compute(x.shape, lambda *i: x[[x.shape[k] - 1 - i[k] if k in flipped else i[k]
                                          for k in range(x.ndim)]])


def _rolled(x: TensorNode, shift: list[int]) -> TensorNode:
    """`x` with element i of each dim k moved to (i + shift[k]) mod size, wrapping around."""
    offset = [-s % n if n else 0 for s, n in zip(shift, x.shape)]
    return compute(x.shape, lambda *i: x[[(i[k] + offset[k]) % n if n else i[k]
                                          for k, n in enumerate(x.shape)]])


@operator("roll")
def roll(x, shifts, dims=None):
    """`x` with elements shifted by `shifts` along `dims`, wrapping around (dims None: the
    flattened tensor, shape restored)."""
    shifts = _ints("roll", "shifts", shifts)
    if dims is None:
        if len(shifts) != 1:
            raise OperatorError(f"roll: without dims, shifts must be one int, got {shifts}")
        n = math.prod(x.shape)
        return reshaped(_rolled(reshaped(x, (n,)), shifts), x.shape)
    dims = _ints("roll", "dims", dims)
    if len(dims) != len(shifts):
        raise OperatorError(f"roll: shifts {shifts} and dims {dims} must have the same length")
    shift = [0] * x.ndim
    for d, s in zip(dims, shifts):
        shift[normalize_dim("roll", d, x.ndim)] += s
    return _rolled(x, shift)


def _repeated(op: str, x: TensorNode, repeats: list[int]) -> TensorNode:
    """`x`, with size-1 dims leading to match `repeats`, repeated `repeats[k]` times along dim k."""
    lead = len(repeats) - x.ndim
    if lead < 0 or any(r < 0 for r in repeats):
        raise OperatorError(f"{op}: repeats {tuple(repeats)} must be non-negative, at least one per "
                            f"dim of shape {x.shape}")
    src = (1,) * lead + x.shape
    shape = [s * r for s, r in zip(src, repeats)]
    return compute(shape, lambda *i: x[[i[k + lead] % n if n else i[k + lead]
                                        for k, n in enumerate(x.shape)]])


@operator("repeat")
def repeat(x, repeats):
    """`x` repeated `repeats[k]` times along each dim k (torch.Tensor.repeat: `repeats` may
    have more entries than `x` has dims; new dims lead)."""
    repeats = _ints("repeat", "repeats", repeats)
    return _repeated("repeat", x, repeats)


@operator("tile")
def tile(x, dims):
    """`x` repeated `dims[k]` times along each dim (torch.tile: missing entries of `dims` are 1)."""
    dims = _ints("tile", "dims", dims)
    return _repeated("tile", x, [1] * (x.ndim - len(dims)) + dims)


def _joined(op: str, tensors: list[TensorNode], dim: int, dtype) -> TensorNode:
    """`tensors` concatenated along `dim` (counted from 0), converted to `dtype`."""
    first = tensors[0]
    for t in tensors[1:]:
        if t.ndim != first.ndim or any(a != b for k, (a, b) in enumerate(zip(t.shape, first.shape))
                                       if k != dim):
            raise OperatorError(f"{op}: shapes {', '.join(str(u.shape) for u in tensors)} must match "
                                f"except in dim {dim}")
    shape = list(first.shape)
    shape[dim] = sum(u.shape[dim] for u in tensors)
    starts = [sum(u.shape[dim] for u in tensors[:k]) for k in range(len(tensors))]
    parts = [(u, s) for u, s in zip(tensors, starts) if u.shape[dim]]

    def value(*i):
        def pick(lo: int, hi: int):
            """The element from parts[lo:hi], chosen by a balanced tree of comparisons."""
            if hi - lo == 1:
                u, start = parts[lo]
                return cast(u[[i[k] - start if k == dim else i[k] for k in range(len(shape))]], dtype)
            mid = (lo + hi) // 2
            return select(i[dim] < parts[mid][1], pick(lo, mid), pick(mid, hi))

        return pick(0, len(parts)) if parts else cast(0, dtype)

    return compute(shape, value)


def _concat(op: str, tensors: list[TensorNode], dim: int) -> TensorNode:
    if not isinstance(tensors, list) or not tensors:
        raise OperatorError(f"{op}: expected a non-empty list of tensors, got {tensors!r}")
    if any(t.ndim == 0 for t in tensors):
        raise OperatorError(f"{op}: 0-d tensors cannot be joined along a dim, got shapes "
                            f"{', '.join(str(t.shape) for t in tensors)}")
    # PyTorch skips 1-d empty tensors, a legacy of their use as placeholders
    kept = [t for t in tensors if t.shape != (0,)] or tensors[:1]
    return _joined(op, kept, normalize_dim(op, dim, kept[0].ndim), result_type(*tensors))


@operator("concat", traits=Traits(layout=Layout.ALONG_DIM))
def concat(tensors, dim=0):
    """`tensors` joined along the existing dim `dim`, with type promotion."""
    return _concat("concat", tensors, dim)


@operator("cat", traits=Traits(layout=Layout.ALONG_DIM))
def cat(tensors, dim=0):
    """The same as `concat`."""
    return _concat("cat", tensors, dim)


@operator("stack")
def stack(tensors, dim=0):
    """`tensors` (all of one shape) joined along a new dim `dim`, with type promotion."""
    if not isinstance(tensors, list) or not tensors:
        raise OperatorError(f"stack: expected a non-empty list of tensors, got {tensors!r}")
    if len({t.shape for t in tensors}) > 1:
        raise OperatorError(f"stack: all tensors must have one shape, got "
                            f"{', '.join(str(t.shape) for t in tensors)}")
    d = normalize_dim("stack", dim, tensors[0].ndim + 1)
    return _joined("stack", [reshaped(t, t.shape[:d] + (1,) + t.shape[d:]) for t in tensors], d,
                   result_type(*tensors))


def narrowed(x: TensorNode, dim: int, start: int, length: int, step: int = 1) -> TensorNode:
    """Elements start, start + step, ... (`length` of them) of `x` along `dim`."""
    shape = list(x.shape)
    shape[dim] = length
    return compute(shape, lambda *i: x[[start + i[k] * step if k == dim else i[k] for k in range(x.ndim)]])


def _pieces(x: TensorNode, dim: int, sizes: list[int]) -> tuple[TensorNode, ...]:
    starts = [sum(sizes[:k]) for k in range(len(sizes))]
    return tuple(narrowed(x, dim, s, n) for s, n in zip(starts, sizes))


def _cut(n: int, size: int) -> list[int]:
    """Sizes of the pieces of `size` elements (the last one may be smaller) covering `n`."""
    return [min(size, n - s) for s in range(0, n, size)]


@operator("split", traits=Traits(layout=Layout.ALONG_DIM))
def split(x, split_size_or_sections, dim=0):
    """`x` cut along `dim` into pieces of `split_size_or_sections` elements (the last may be
    smaller) or of the listed sizes; a tuple of tensors."""
    d = dim_of("split", dim, x)
    n = x.shape[d]
    if isinstance(split_size_or_sections, int) and not isinstance(split_size_or_sections, bool):
        size = split_size_or_sections
        if size < 0 or (size == 0 and n):
            raise OperatorError(f"split: split size must be positive, got {size} for dim {dim} of size {n}")
        sizes = _cut(n, size) if n else [0]
    else:
        sizes = _ints("split", "split sizes", split_size_or_sections)
        if sum(sizes) != n or any(s < 0 for s in sizes):
            raise OperatorError(f"split: sizes {sizes} must be non-negative and sum to {n}, "
                                f"the size of dim {dim} of shape {x.shape}")
    return _pieces(x, d, sizes)


@operator("chunk", traits=Traits(layout=Layout.ALONG_DIM))
def chunk(x, chunks, dim=0):
    """`x` cut along `dim` into `chunks` pieces of ceil(size / chunks) elements (fewer pieces
    when that runs out first, as in PyTorch); a tuple of tensors."""
    d = dim_of("chunk", dim, x)
    if not isinstance(chunks, int) or chunks <= 0:
        raise OperatorError(f"chunk: chunks must be a positive int, got {chunks!r}")
    n = x.shape[d]
    return _pieces(x, d, _cut(n, -(-n // chunks)) if n else [0] * chunks)


def _strided(op: str, x: TensorNode, size, stride, storage_offset) -> tuple[list[int], list[int], int]:
    """The checked (size, stride, storage offset) of a strided view of `x`'s elements taken in
    row-major order as its storage: every position it reaches lies among them."""
    size, stride = _ints(op, "size", size), _ints(op, "stride", stride)
    start = as_index(storage_offset)
    numel = math.prod(x.shape)
    last = start + sum((n - 1) * s for n, s in zip(size, stride))
    if len(size) != len(stride) or min(size + stride + [start], default=0) < 0 or (
            math.prod(size) and last >= numel):
        raise OperatorError(f"{op}: size {tuple(size)}, stride {tuple(stride)} and storage offset "
                            f"{start} do not describe a view of the {numel} elements of a {x.dtype} "
                            f"tensor of shape {x.shape} taken in row-major order")
    return size, stride, start


@operator("as_strided")
def as_strided(x, size, stride, storage_offset=0):
    """The strided view of `x`'s elements taken in row-major order as its storage, as
    `torch.as_strided` views a contiguous `x`: element j is the one at flat position
    storage_offset + sum(j[k] * stride[k]) (positions may repeat, as in an expanded view)."""
    size, stride, start = _strided("as_strided", x, size, stride, storage_offset)
    return compute(size, lambda *j: x[unravel(start + sum(i * s for i, s in zip(j, stride)), x.shape)])


@operator("as_strided_scatter")
def as_strided_scatter(x, src, size, stride, storage_offset=0):
    """`x` with `src` (of shape `size`) written over `as_strided(x, size, stride, storage_offset)`.
    The view's elements must be distinct, its strides nesting (each larger than the span of the
    smaller ones), so that each element of `x` finds the one element of `src` written over it
    by dividing its position by the strides, largest first."""
    size, stride, start = _strided("as_strided_scatter", x, size, stride, storage_offset)
    if tuple(src.shape) != tuple(size):
        raise OperatorError(f"as_strided_scatter: src of shape {src.shape} must have the view's "
                            f"size {tuple(size)}")
    order = sorted((k for k, n in enumerate(size) if n > 1), key=lambda k: -stride[k])
    for rank, k in enumerate(order):
        if stride[k] <= sum((size[i] - 1) * stride[i] for i in order[rank + 1:]):
            raise OperatorError(f"as_strided_scatter: size {tuple(size)} and stride {tuple(stride)} "
                                f"describe a view whose elements overlap (or do not nest): which "
                                f"write wins is undefined")
    if not math.prod(size):
        return compute(x.shape, lambda *p: x[p])

    def element(*p):
        offset = as_expr(ravel(p, x.shape) - start, dtypes.int64)
        hit, rest, j = offset >= 0, offset, [0] * len(size)
        for k in order:
            j[k] = rest // stride[k]
            hit = hit & (j[k] < size[k])
            rest = rest % stride[k]
        hit = hit & eq(rest, 0)
        written = src[[clamp_index(i, n) for i, n in zip(j, size)]]
        return select(hit, cast(written, x.dtype), x[p])

    return compute(x.shape, element)
