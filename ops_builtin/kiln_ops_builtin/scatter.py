"""Scatter operators: scatter, scatter_reduce (and scatter_add), index_add, index_copy,
index_fill, index_put and masked_scatter; checked_count, which fails where a mask selects
other than the number of positions a scatter expects; embedding_backward, the gradient of an
embedding's table.

Each is written from the output's side, so it is one parallel compute with no atomics and a
deterministic result: output element p gathers the candidates (source elements whose index
points at p) by a reduction over the scattered axis. That costs O(n * m) for an output dim of n
and m candidates, right for the index sizes of models, not for huge scatters. Where several
candidates write one element without reduction, the last one wins (PyTorch's CPU order).
Negative indices count from the end; an index out of range fails the kernel (IndexError on the
CPU, a trap on CUDA) instead of matching nothing.

A `Scattered` describes each scatter from both sides: the candidates of an output element for
these compute definitions, and where each source element goes, for schedules that add every
source into its target once (`reduction`; the CUDA template `scatter_atomic`).

Each reads x only at the output element's own index (`own`), and declares `Traits(in_place="x")`:
where x is an intermediate nothing reads afterwards, the result takes its buffer.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable

import torch

from kiln import dtypes, ir
from kiln.ir.size import size_text
from kiln.graph import OperatorError, Traits, Update, operator
from kiln.ir import TensorNode, cast, compute, reduce, select, unravel

from kiln_ops_builtin.common import (accumulator_type, broadcast_load, broadcast_shape, clamp_index,
                                     normalize_dim, ravel)
from kiln_ops_builtin.indexing import checked_index

INDEX_TYPES = (dtypes.int64, dtypes.int32)
REDUCTIONS = ("sum", "prod", "mean", "amax", "amin")


def _position(op: str, i, dim: int, size: int):
    """Index value `i` along `dim` of `size` with negative values counted from the end, as int64;
    the kernel fails on values outside [-size, size)."""
    message = f"{op}: index {{value}} is out of bounds for dimension {dim} with size {size_text(size)}"
    return checked_index(i, size, message, wrap=True)


def _check_index(op: str, index: TensorNode) -> None:
    if index.dtype not in INDEX_TYPES:
        raise OperatorError(f"{op}: index must be int64 or int32, got {index.dtype}")


@dataclass(frozen=True)
class Scattered:
    """One scatter into `x`, seen from both sides.

    From the sources: source element s (a multi-index over `sources`) goes to the element of
    `x` at `target(s)` (one index expression per dim of x, or one for a 0-d x; user indices
    wrapped and checked) with the value `value(s)`. From the output: element p of x gathers
    the source elements `source_of(p, r)` over the candidates r (a multi-index over
    `candidates`) whose targets equal p in the `scattered` dims and for which every condition
    of `inside(p)` holds."""

    sources: tuple[int, ...]
    target: Callable
    value: Callable
    candidates: list[int]
    source_of: Callable
    scattered: tuple[int, ...]
    inside: Callable = lambda p: ()

    def match(self, p, r):
        """Whether candidate r of output element p lands on it."""
        target, at = self.target(self.source_of(p, r)), list(p) or [0]
        hit = None
        for k in self.scattered:
            h = ir.eq(target[k], at[k])
            hit = h if hit is None else hit & h
        for condition in self.inside(p):
            hit = hit & condition
        return hit

    def scaled(self, alpha) -> "Scattered":
        """The same scatter with every value multiplied by `alpha` (none where it is 1)."""
        return self if alpha == 1 else replace(self, value=lambda s, value=self.value: value(s) * alpha)


def _gathered(x: TensorNode, scattered: Scattered, how: str, include_self: bool = True):
    """Output of `x`'s shape: element p combines the values of its candidates by `how` ('last'
    or one of REDUCTIONS)."""
    out_t = x.dtype
    extents = scattered.candidates
    match = scattered.match

    def value(p, r):
        return scattered.value(scattered.source_of(p, r))

    def element(*p):
        own = x[p]
        if how == "last":
            last = reduce(extents, lambda *r: select(match(p, r), ravel(r, extents), -1), "max", dtypes.int64)
            return select(last >= 0, cast(value(p, unravel(ir.maximum(last, 0), extents)), out_t), own)
        acc = accumulator_type(out_t)
        count = reduce(extents, lambda *r: cast(match(p, r), dtypes.int64), dtype=dtypes.int64)
        if how in ("sum", "mean", "prod"):
            neutral = 1 if how == "prod" else 0
            total = reduce(extents, lambda *r: select(match(p, r), cast(value(p, r), acc), cast(neutral, acc)),
                           "prod" if how == "prod" else "sum", acc)
            if include_self:
                total = total * cast(own, acc) if how == "prod" else total + cast(own, acc)
            if how == "mean":
                n = cast(count + int(include_self), acc)
                total = total / n if out_t.is_float else total // n
            return select(count > 0, cast(total, out_t), own)
        lowest = -math.inf if out_t.is_float else _limit(out_t, low=True)
        highest = math.inf if out_t.is_float else _limit(out_t, low=False)
        how_ = "max" if how == "amax" else "min"
        fill = lowest if how == "amax" else highest
        best = reduce(extents, lambda *r: select(match(p, r), cast(value(p, r), out_t), cast(fill, out_t)),
                      how_, out_t)
        if include_self:
            best = (ir.maximum if how == "amax" else ir.minimum)(best, own)
        return select(count > 0, best, own)

    return compute(x.shape, element)


def _limit(t: dtypes.DataType, low: bool) -> int:
    """The lowest or highest value of integer (or bool) type `t`."""
    info = torch.iinfo(t.torch_dtype) if not t.is_bool else None
    return (0 if low else 1) if info is None else (info.min if low else info.max)


def _along_dim(op: str, x: TensorNode, dim, index: TensorNode, src) -> Scattered:
    """Scatter-like operators: index and src have x's rank, index no larger than x outside
    `dim` (and than src everywhere); source element s goes to s with dim replaced by index[s]."""
    d = normalize_dim(op, dim, x.ndim)
    _check_index(op, index)
    if index.ndim != x.ndim or any(index.shape[k] > x.shape[k] for k in range(x.ndim) if k != d):
        raise OperatorError(f"{op}: index of shape {index.shape} must have the rank of input shape "
                            f"{x.shape} and no larger size outside dim {dim}")
    if isinstance(src, TensorNode) and (src.ndim != index.ndim or
                                        any(a > b for a, b in zip(index.shape, src.shape))):
        raise OperatorError(f"{op}: src of shape {src.shape} must have the rank of index {index.shape} "
                            "and be no smaller in any dim")
    n = x.shape[d] if x.ndim else 1
    m = index.shape[d] if index.ndim else 1

    def target(s):
        return [_position(op, index[s], d, n) if k == d else s[k] for k in range(max(x.ndim, 1))]

    def source_of(p, r):
        return [r[0] if k == d else clamp_index(p[k], index.shape[k]) for k in range(x.ndim)]

    def inside(p):
        return [p[k] < index.shape[k] for k in range(x.ndim) if k != d and index.shape[k] < x.shape[k]]

    def value(s):
        return src[s] if isinstance(src, TensorNode) else src

    return Scattered(tuple(index.shape), target, value, [m], source_of, (d,), inside)


def _update(x, scattered: Scattered) -> Update:
    """The elements `scattered` replaces in x, seen from its sources (the trait `updates`)."""
    return Update(x, tuple(scattered.sources), scattered.target, scattered.value)


def _scatter_update(x, dim, index, src):
    return _update(x, _along_dim("scatter", x, dim, index, src))


@operator("scatter", traits=Traits(updates=_scatter_update, in_place="x"))
def scatter(x, dim, index, src):
    """x with src[j] (a tensor, or one Python scalar) written at x[j with dim replaced by index[j]]."""
    return _gathered(x, _along_dim("scatter", x, dim, index, src), "last")


def _scatter_reduce(x, dim, index, src, reduce, include_self=True):
    if reduce not in REDUCTIONS:
        raise OperatorError(f"scatter_reduce: reduce must be one of {', '.join(REDUCTIONS)}, got {reduce!r}")
    return _along_dim("scatter_reduce", x, dim, index, src), reduce, include_self


@operator("scatter_reduce", traits=Traits(in_place="x"))
def scatter_reduce(x, dim, index, src, reduce, include_self=True):
    """x with src[j] combined into x[j with dim replaced by index[j]] by `reduce` ('sum', 'prod',
    'mean', 'amax' or 'amin'); without `include_self` x's own value joins only untouched elements."""
    return _gathered(x, *_scatter_reduce(x, dim, index, src, reduce, include_self))


def _scatter_add(x, dim, index, src):
    return _along_dim("scatter_add", x, dim, index, src), "sum", True


@operator("scatter_add", traits=Traits(in_place="x"))
def scatter_add(x, dim, index, src):
    """x with src[j] added into x[j with dim replaced by index[j]]."""
    return _gathered(x, *_scatter_add(x, dim, index, src))


def _index_along(op: str, x: TensorNode, dim, index: TensorNode, source) -> Scattered:
    """index_* operators: a 1-D index picks slices of x along `dim`; source element s goes to s
    with dim replaced by index[s along dim]."""
    d = normalize_dim(op, dim, x.ndim)
    _check_index(op, index)
    if index.ndim > 1:
        raise OperatorError(f"{op}: index must be 0-D or 1-D, got shape {index.shape}")
    m = index.shape[0] if index.ndim else 1
    if isinstance(source, TensorNode):
        want = tuple(m if k == d else s for k, s in enumerate(x.shape))
        if source.shape != want and not (source.ndim == 0 and x.ndim <= 1):
            raise OperatorError(f"{op}: source of shape {source.shape} must have shape {want} "
                                f"(input {x.shape}, {m} indices along dim {dim})")
    n = x.shape[d] if x.ndim else 1
    shape = x.shape or (1,)

    def target(s):
        return [_position(op, index[[s[d]] if index.ndim else []], d, n) if k == d else s[k]
                for k in range(len(shape))]

    def source_of(p, r):
        return [r[0] if k == d else p[k] for k in range(x.ndim)] or [r[0]]

    def value(s):
        return source[s[:source.ndim]] if isinstance(source, TensorNode) else source

    return Scattered(tuple(m if k == d else size for k, size in enumerate(shape)), target, value, [m], source_of,
                     (d,))


def _index_add(x, dim, index, source, alpha=1):
    return _index_along("index_add", x, dim, index, source).scaled(alpha), "sum", True


@operator("index_add", traits=Traits(in_place="x"))
def index_add(x, dim, index, source, alpha=1):
    """x with alpha * source[.., j, ..] added into x[.., index[j], ..] along `dim`."""
    return _gathered(x, *_index_add(x, dim, index, source, alpha))


def _index_copy_update(x, dim, index, source):
    return _update(x, _index_along("index_copy", x, dim, index, source))


@operator("index_copy", traits=Traits(updates=_index_copy_update, in_place="x"))
def index_copy(x, dim, index, source):
    """x with source[.., j, ..] written at x[.., index[j], ..] along `dim`."""
    return _gathered(x, _index_along("index_copy", x, dim, index, source), "last")


@operator("index_fill", traits=Traits(in_place="x"))
def index_fill(x, dim, index, value):
    """x with every slice x[.., index[j], ..] along `dim` set to `value` (a Python scalar or a
    0-d tensor)."""
    if isinstance(value, TensorNode):
        if value.ndim:
            raise OperatorError(f"index_fill: value must be a scalar or a 0-d tensor, got shape {value.shape}")
        fill = value
        scattered = _index_along("index_fill", x, dim, index, None)
        return _gathered(x, replace(scattered, value=lambda s: fill[()]), "last")
    return _gathered(x, _index_along("index_fill", x, dim, index, value), "last")


def _index_put(x, indices, values, accumulate=False):
    if not isinstance(indices, (list, tuple)) or not indices or len(indices) > x.ndim:
        raise OperatorError(f"index_put: indices must be 1 to {x.ndim} index tensors, got {indices!r}")
    for t in indices:
        if not isinstance(t, TensorNode):
            raise OperatorError("index_put: only index tensors are supported (no None/slices)")
        _check_index("index_put", t)
    k = len(indices)
    index_shape = broadcast_shape("index_put", *[t.shape for t in indices])
    target_shape = tuple(index_shape) + tuple(x.shape[k:])
    if isinstance(values, TensorNode):
        broadcast_shape("index_put", values.shape, target_shape)
    extents = [math.prod(index_shape)] if index_shape else [1]
    n = len(index_shape)

    def target(s):
        return [_position("index_put", broadcast_load(t, s[:n], index_shape), m, x.shape[m])
                for m, t in enumerate(indices)] + list(s[n:])

    def source_of(p, r):
        return list(unravel(r[0], index_shape)) + list(p[k:])

    def value(s):
        return broadcast_load(values, s, target_shape) if isinstance(values, TensorNode) else values

    scattered = Scattered(target_shape, target, value, extents, source_of, tuple(range(k)))
    return scattered, "sum" if accumulate else "last", True


def _index_put_update(x, indices, values, accumulate=False):
    scattered, how, _ = _index_put(x, indices, values, accumulate)
    return _update(x, scattered) if how == "last" else None


@operator("index_put", traits=Traits(updates=_index_put_update, in_place="x"))
def index_put(x, indices, values, accumulate=False):
    """x with `values` written (or added, with `accumulate`) at the positions the integer index
    tensors `indices` give for x's leading dims; indices broadcast together, values broadcast
    to the indexed shape."""
    return _gathered(x, *_index_put(x, indices, values, accumulate))


@operator("masked_scatter")
def masked_scatter(x, mask, source):
    """x with the elements where the bool `mask` (broadcast to x) holds replaced, in row-major
    order, by consecutive elements of `source`."""
    if mask.dtype != dtypes.boolean:
        raise OperatorError(f"masked_scatter: mask must be bool, got {mask.dtype}")
    shape = broadcast_shape("masked_scatter", x.shape, mask.shape)
    if tuple(shape) != tuple(x.shape):
        raise OperatorError(f"masked_scatter: mask of shape {mask.shape} must broadcast to input {x.shape}")
    total = math.prod(source.shape)

    def element(*p):
        flat = ravel(p, x.shape)
        before = reduce([flat], lambda q: cast(broadcast_load(mask, unravel(q, x.shape), x.shape), dtypes.int64),
                        dtype=dtypes.int64)
        taken = source[unravel(ir.minimum(before, total - 1), source.shape)] if total else x[p]
        return select(broadcast_load(mask, p, x.shape), cast(taken, x.dtype), x[p])

    return compute(x.shape, element)


@operator("checked_count")
def checked_count(x, count, expected, message: str):
    """`x` unchanged where the 0-d integer `count`, known only from the data (the positions a
    mask selects), is `expected`; where it is not, a kernel computing it fails (RuntimeError on
    the CPU, with `message`, in which `{value}` shows `count`), as eager PyTorch raises."""
    if count.ndim != 0 or count.dtype not in INDEX_TYPES:
        raise OperatorError(f"checked_count: count must be a 0-d int64 or int32, got {count.dtype}{count.shape}")
    return compute(x.shape, lambda *i: ir.check(ir.eq(count[()], expected), x[i], "RuntimeError", message,
                                                count[()]))


def _index_reduce(x, dim, index, source, reduce, include_self=True):
    if reduce not in ("prod", "mean", "amax", "amin"):
        raise OperatorError(f"index_reduce: reduce must be 'prod', 'mean', 'amax' or 'amin', got {reduce!r}")
    return _index_along("index_reduce", x, dim, index, source), reduce, include_self


@operator("index_reduce", traits=Traits(in_place="x"))
def index_reduce(x, dim, index, source, reduce, include_self=True):
    """x with source[.., j, ..] combined into x[.., index[j], ..] along `dim` by `reduce`
    ('prod', 'mean', 'amax' or 'amin')."""
    return _gathered(x, *_index_reduce(x, dim, index, source, reduce, include_self))


@operator("embedding_backward")
def embedding_backward(grad, indices, num_weights: int, padding_idx: int = -1):
    """The gradient of an embedding's table of `num_weights` rows (aten.embedding_dense_backward
    without scale_grad_by_freq), for token gradients `grad` [T, D] and their rows `indices`
    [T]: row v is the sum of the grad rows whose index is v, accumulated in float32 for 16-bit
    grads (PyTorch's opmath type: as torch's float32 scatter into zeros), rounded once to grad's
    dtype; the row `padding_idx` (where it is one, in [0, num_weights)) is 0. An index outside
    [0, num_weights) fails the kernel.

    The result is made in grad's dtype directly: on CUDA the template `embedding_grad` sorts
    the tokens and sums each index's rows in float32 scratch of O(T * D), never a float32 table.
    Written, as the other scatters, from the output's side: O(num_weights * T * D)."""
    op = "embedding_backward"
    if grad.ndim != 2 or indices.ndim != 1 or indices.shape[0] != grad.shape[0]:
        raise OperatorError(f"{op}: expected grad [T, D] and indices [T], got shapes {grad.shape} and {indices.shape}")
    if not grad.dtype.is_float:
        raise OperatorError(f"{op}: grad must be floating-point, got {grad.dtype}")
    _check_index(op, indices)
    if not isinstance(num_weights, int) or num_weights < 0:
        raise OperatorError(f"{op}: num_weights must be a non-negative int, got {num_weights!r}")
    tokens = indices.shape[0]
    acc = accumulator_type(grad.dtype)
    message = f"{op}: index {{value}} is out of range for a weight of {num_weights} rows"
    padding = padding_idx if isinstance(padding_idx, int) and 0 <= padding_idx < num_weights else None

    def element(v, d):
        total = reduce([tokens], lambda t: select(ir.eq(checked_index(indices[t], num_weights, message), v),
                                                  cast(grad[t, d], acc), cast(0, acc)), dtype=acc)
        if padding is not None:
            total = select(ir.eq(v, padding), cast(0, acc), total)
        return cast(total, grad.dtype)

    return compute([num_weights, grad.shape[1]], element)


_REDUCING = {"scatter_add": _scatter_add, "scatter_reduce": _scatter_reduce, "index_add": _index_add,
             "index_put": _index_put, "index_reduce": _index_reduce}


def reduction(op: str, arguments: dict) -> tuple[Scattered, str, bool] | None:
    """(scatter, reduction, include_self) of a call of operator `op` (its arguments by parameter
    name) that combines its sources into x by a reduction of REDUCTIONS; None for any other
    call (a scatter whose last source wins, another operator)."""
    build = _REDUCING.get(op)
    if build is None:
        return None
    found = build(**arguments)
    return found if found[1] in REDUCTIONS else None
