"""Order statistics along one dim: sort, argsort, topk, kthvalue, median, nanmedian and mode.

Each is a rank-by-counting network, fully parallel and the same on every target: the rank of
element i in its row is the number of elements ordered before it (smaller, or equal with a
lower position, so ties keep their order: a stable sort), and the element of rank k is found by
a second count. Work is O(n^2) per row of length n: right for the rows of a few thousand that
models sort (top-k sampling, median filters), slow for long ones. On CUDA the template
`kiln_ops_builtin.templates.sort_bitonic` computes the same results (all but mode's) by sorting
each row; these definitions remain the CPU's and any other target's.

NaN orders above every number (first when descending), as in PyTorch.
"""
from __future__ import annotations

import math

from kiln import dtypes, ir
from kiln.graph import OperatorError, Traits, operator
from kiln.ir import TensorNode, cast, compute, reduce, select

from kiln_ops_builtin.common import clamp_index, normalize_dim


COMPARED = Traits(compares_elements=True)
"""Every definition here ranks its input's elements against each other."""


def _with(index, d: int, r) -> list:
    """`index` with position `d` replaced by `r`."""
    return [r if k == d else v for k, v in enumerate(index)]


def _key(x: TensorNode, index):
    """The element of `x` at `index` in a type that compares as PyTorch orders it."""
    v = x[index]
    return cast(v, dtypes.uint8) if x.dtype.is_bool else v


def _before(a, b, descending: bool):
    """Whether value `a` orders strictly before value `b`."""
    if descending:
        a, b = b, a
    less = a < b
    return (less | (ir.isnan(b) & ir.logical_not(ir.isnan(a)))) if a.dtype.is_float else less


def _same(a, b):
    equal = ir.eq(a, b)
    return (equal | (ir.isnan(a) & ir.isnan(b))) if a.dtype.is_float else equal


def _dim(op: str, x: TensorNode, dim) -> int:
    d = normalize_dim(op, dim, x.ndim)
    if x.ndim and x.shape[d] == 0:
        raise OperatorError(f"{op}: dim {dim} of shape {x.shape} is empty")
    return d


def ranks(x: TensorNode, d: int, descending: bool = False) -> TensorNode:
    """The int64 stable rank of each element of `x` within its row along `d`."""
    n = x.shape[d]

    def element(*i):
        xi = _key(x, i)

        def ahead(r):
            xr = _key(x, _with(i, d, r))
            return cast(_before(xr, xi, descending) | (_same(xr, xi) & (r < i[d])), dtypes.int64)

        return reduce([n], ahead, dtype=dtypes.int64)

    return compute(x.shape, element)


def position_of_rank(rank: TensorNode, d: int, shape, which) -> TensorNode:
    """int64 computes of `shape` (`rank`'s, but for dim `d`): the position along `d` of the
    element whose rank is `which(i)` (an int or an expression of the output index)."""
    n = rank.shape[d]
    return compute(shape, lambda *i: reduce(
        [n], lambda r: select(ir.eq(rank[_with(i, d, r)], which(i)), r, 0), dtype=dtypes.int64))


def _pick(x: TensorNode, d: int, positions: TensorNode) -> TensorNode:
    return compute(positions.shape, lambda *i: x[_with(i, d, clamp_index(positions[i], x.shape[d]))])


def _kept(t: TensorNode, d: int, keepdim: bool) -> TensorNode:
    """`t` (of size 1 along `d`) with dim `d` kept, or dropped."""
    if keepdim:
        return t
    return compute([n for k, n in enumerate(t.shape) if k != d], lambda *i: t[list(i[:d]) + [0] + list(i[d:])])


def _first_ranks(op: str, x: TensorNode, dim, k: int, descending: bool):
    """(values, indices) of the elements of rank 0..k-1 along `dim`, in rank order."""
    if x.ndim == 0:
        return compute((), lambda: x[()]), compute((), lambda: cast(0, dtypes.int64))
    d = _dim(op, x, dim)
    shape = _with(x.shape, d, k)
    positions = position_of_rank(ranks(x, d, descending), d, shape, lambda i: i[d])
    return _pick(x, d, positions), positions


@operator("sort", traits=COMPARED)
def sort(x, dim=-1, descending=False):
    """(values, int64 indices) of `x` sorted along `dim`; stable (equal elements keep their order)."""
    n = x.shape[normalize_dim("sort", dim, x.ndim)] if x.ndim else 1
    return _first_ranks("sort", x, dim, n, descending)


@operator("argsort", traits=COMPARED)
def argsort(x, dim=-1, descending=False):
    """The int64 positions that sort `x` along `dim` (stable)."""
    n = x.shape[normalize_dim("argsort", dim, x.ndim)] if x.ndim else 1
    return _first_ranks("argsort", x, dim, n, descending)[1]


@operator("topk", traits=COMPARED)
def topk(x, k, dim=-1, largest=True):
    """(values, int64 indices) of the `k` largest (or smallest) elements along `dim`, in order."""
    n = x.shape[normalize_dim("topk", dim, x.ndim)] if x.ndim else 1
    if not isinstance(k, int) or not 0 <= k <= n:
        raise OperatorError(f"topk: k={k!r} must be an int in [0, {n}] for dim {dim} of shape {x.shape}")
    return _first_ranks("topk", x, dim, k, largest)


def _statistic(op: str, x: TensorNode, dim, keepdim: bool, which, nan_first: bool):
    """(values, indices) of the element of rank `which(row index)` along `dim` (a row with a
    NaN gives its first NaN where `nan_first`)."""
    if x.ndim == 0:
        return compute((), lambda: x[()]), compute((), lambda: cast(0, dtypes.int64))
    d = _dim(op, x, dim)
    row_shape = _with(x.shape, d, 1)
    positions = position_of_rank(ranks(x, d), d, row_shape, which)
    if nan_first and x.dtype.is_float:
        n = x.shape[d]
        first_nan = compute(row_shape, lambda *i: reduce(
            [n], lambda r: cast(ir.isnan(x[_with(i, d, r)]), dtypes.int8), "argmax"))
        has_nan = compute(row_shape, lambda *i: ir.isnan(x[_with(i, d, first_nan[i])]))
        positions = compute(row_shape, lambda *i: select(has_nan[i], first_nan[i], positions[i]))
    return _kept(_pick(x, d, positions), d, keepdim), _kept(positions, d, keepdim)


@operator("kthvalue", traits=COMPARED)
def kthvalue(x, k, dim=-1, keepdim=False):
    """(values, indices) of the `k`-th smallest element (k counted from 1) along `dim`."""
    n = x.shape[normalize_dim("kthvalue", dim, x.ndim)] if x.ndim else 1
    if not isinstance(k, int) or not 1 <= k <= n:
        raise OperatorError(f"kthvalue: k={k!r} must be an int in [1, {n}] for dim {dim} of shape {x.shape}")
    return _statistic("kthvalue", x, dim, keepdim, lambda i: k - 1, nan_first=False)


@operator("median", traits=COMPARED)
def median(x, dim=-1, keepdim=False):
    """(values, indices) of the lower median along `dim`; a row holding NaN gives its first NaN."""
    n = x.shape[normalize_dim("median", dim, x.ndim)] if x.ndim else 1
    return _statistic("median", x, dim, keepdim, lambda i: (n - 1) // 2, nan_first=True)


@operator("nanmedian", traits=COMPARED)
def nanmedian(x, dim=-1, keepdim=False):
    """(values, indices) of the lower median of the non-NaN elements along `dim` (NaN if all are)."""
    if x.ndim == 0 or not x.dtype.is_float:
        return median.definition(x, dim, keepdim)
    d = _dim("nanmedian", x, dim)
    n = x.shape[d]
    count = compute(_with(x.shape, d, 1), lambda *i: reduce(
        [n], lambda r: cast(ir.logical_not(ir.isnan(x[_with(i, d, r)])), dtypes.int64), dtype=dtypes.int64))
    # NaNs rank last, so the non-NaN median has rank (count - 1) // 2; all NaN gives rank 0, a NaN
    return _statistic("nanmedian", x, dim, keepdim,
                      lambda i: ir.maximum(count[_with(i, d, 0)] - 1, 0) // 2, nan_first=False)


@operator("mode", traits=COMPARED)
def mode(x, dim=-1, keepdim=False):
    """(values, indices) of the most frequent value along `dim` (the smallest among equally
    frequent ones) and the last position holding it."""
    if x.ndim == 0:
        return compute((), lambda: x[()]), compute((), lambda: cast(0, dtypes.int64))
    d = _dim("mode", x, dim)
    n = x.shape[d]
    count = compute(x.shape, lambda *i: reduce(
        [n], lambda r: cast(_same(_key(x, _with(i, d, r)), _key(x, i)), dtypes.int64), dtype=dtypes.int64))
    row_shape = _with(x.shape, d, 1)
    most = compute(row_shape, lambda *i: reduce([n], lambda r: count[_with(i, d, r)], "max"))
    rank = ranks(x, d)
    # among the most frequent elements, the one of lowest rank is the smallest value
    first = compute(row_shape, lambda *i: reduce([n], lambda r: select(
        ir.eq(count[_with(i, d, r)], most[i]), rank[_with(i, d, r)], n), "min"))
    smallest = position_of_rank(rank, d, row_shape, lambda i: first[i])
    last = compute(row_shape, lambda *i: reduce([n], lambda r: select(
        _same(_key(x, _with(i, d, r)), _key(x, _with(i, d, smallest[i]))), r, -1), "max"))
    return _kept(_pick(x, d, last), d, keepdim), _kept(last, d, keepdim)
