"""Reductions over any axes, with PyTorch's result types: sum, mean, prod, extremes and their
positions, var and std (two-pass), all and any; and cumsum.

Sums of integers and bools accumulate and return int64; 16-bit floats accumulate in float32
and return their own type.
"""
from __future__ import annotations

import math

from kiln import dtypes
from kiln.graph import Layout, OperatorError, Traits, operator
from kiln.ir import cast, compute, ne, reduce, sqrt

from kiln_ops_builtin.common import accumulator_type, normalize_dim


class Reduction:
    """A reduction of tensor `x` over the dimensions `dim` (an int, a sequence of ints, or None
    or an empty sequence for all): the result's shape, the extents reduced over and how they
    index `x`."""

    def __init__(self, op: str, x, dim=None, keepdim: bool = False):
        if dim is None or (isinstance(dim, (list, tuple)) and not dim):
            dims = tuple(range(x.ndim))
        else:
            given = [normalize_dim(op, d, x.ndim) for d in (dim if isinstance(dim, (list, tuple)) else [dim])]
            if len(set(given)) != len(given):
                raise OperatorError(f"{op}: dim {tuple(dim)} names a dimension more than once")
            dims = tuple(sorted(set(given))) if x.ndim else ()
        empty = [d for d in dims if x.shape[d] == 0]
        if empty:
            raise OperatorError(f"{op}: cannot reduce over dimension {empty[0]} of size 0 "
                                f"(input shape {x.shape}); empty reductions are not supported")
        self.x, self.dims, self.keepdim = x, dims, keepdim
        self.extents = [x.shape[d] for d in dims]
        self.count = math.prod(self.extents)
        self.shape = tuple(1 if d in dims else s for d, s in enumerate(x.shape) if keepdim or d not in dims)

    def index(self, out, r) -> list:
        """The index into `x` of result element `out` at position `r` of the reduced extents."""
        out, r = iter(out), iter(r)
        index = []
        for d in range(self.x.ndim):
            if d in self.dims:
                index.append(next(r))
                if self.keepdim:
                    next(out)
            else:
                index.append(next(out))
        return index

    def project(self, index) -> list:
        """The index of the result element that element `index` of `x` reduces into."""
        return [0 if d in self.dims else i for d, i in enumerate(index) if self.keepdim or d not in self.dims]

    def compute(self, body, how: str = "sum", acc=None, dtype=None, finish=lambda v: v):
        """The result whose element `out` is `finish` of the `how`-reduction of `body(i)` over the
        indices `i` of `x` that reduce into it, accumulated in `acc`."""
        return compute(self.shape, lambda *o: finish(reduce(self.extents, lambda *r: body(self.index(o, r)),
                                                            how, acc)), dtype=dtype)


def moments(shape, extents, value, acc, correction=0):
    """(mean, variance) computes of `shape`: of `value(s, r)` (an expression of type `acc`) over
    the positions `r` of `extents`, for each element `s`. Two passes: the mean, then the sum of
    squared deviations divided by count - `correction` (at least 0)."""
    count = math.prod(extents)
    mean = compute(shape, lambda *s: reduce(extents, lambda *r: value(s, r), dtype=acc) / count)

    def square_deviation(s, r):
        d = value(s, r) - mean[s]
        return d * d

    var = compute(shape, lambda *s: reduce(extents, lambda *r: square_deviation(s, r), dtype=acc)
                  / max(count - correction, 0))
    return mean, var


def _sum_type(x, dtype):
    """The result type of a sum or product: `dtype` if given, int64 for integers and bools."""
    if dtype is not None:
        return dtypes.data_type(dtype)
    return x.dtype if x.dtype.is_float else dtypes.int64


def require_float(op: str, t: dtypes.DataType) -> None:
    """Raise an OperatorError naming `op` unless the type it computes in, `t`, is a float."""
    if not t.is_float:
        raise OperatorError(f"{op}: input dtype {t} is not supported; {op} is defined for "
                            "floating-point tensors only (pass dtype= to convert integers)")


def _accumulate(op: str, how: str, x, dim, keepdim, dtype):
    out = _sum_type(x, dtype)
    acc = accumulator_type(out)
    return Reduction(op, x, dim, keepdim).compute(lambda i: cast(x[i], acc), how, acc, dtype=out)


@operator("sum", traits=Traits(layout=Layout.REDUCE_DIMS))
def sum_(x, dim=None, keepdim=False, dtype=None):
    """Sum over `dim` (int, ints, or None for all); integers and bools sum to int64."""
    return _accumulate("sum", "sum", x, dim, keepdim, dtype)


@operator("prod")
def prod(x, dim=None, keepdim=False, dtype=None):
    """Product over `dim` (int, ints, or None for all); integers and bools multiply to int64."""
    return _accumulate("prod", "prod", x, dim, keepdim, dtype)


@operator("mean", traits=Traits(layout=Layout.REDUCE_DIMS))
def mean(x, dim=None, keepdim=False, dtype=None):
    """Mean over `dim` (int, ints, or None for all) of a floating-point tensor."""
    out = dtypes.data_type(dtype) if dtype is not None else x.dtype
    require_float("mean", out)
    acc = accumulator_type(out)
    red = Reduction("mean", x, dim, keepdim)
    return red.compute(lambda i: cast(x[i], acc), "sum", acc, dtype=out, finish=lambda v: v / red.count)


def _extreme(op: str, how: str, x, dim=None, keepdim=False):
    return Reduction(op, x, dim, keepdim).compute(lambda i: x[i], how, x.dtype)


@operator("amax", traits=Traits(layout=Layout.REDUCE_DIMS))
def amax(x, dim=None, keepdim=False):
    """Largest element over `dim` (int, ints, or None for all); NaN propagates."""
    return _extreme("amax", "max", x, dim, keepdim)


@operator("amin", traits=Traits(layout=Layout.REDUCE_DIMS))
def amin(x, dim=None, keepdim=False):
    """Smallest element over `dim` (int, ints, or None for all); NaN propagates."""
    return _extreme("amin", "min", x, dim, keepdim)


@operator("max")
def max_(x):
    """The largest element of `x` (torch.max(x)); `max_dim` reduces one dimension."""
    return _extreme("max", "max", x)


@operator("min")
def min_(x):
    """The smallest element of `x` (torch.min(x)); `min_dim` reduces one dimension."""
    return _extreme("min", "min", x)


def _position(op: str, how: str, x, dim, keepdim):
    if x.dtype.is_bool:
        raise OperatorError(f"{op}: bool input is not supported (PyTorch's {op} rejects it too)")
    if dim is not None and not isinstance(dim, int):
        raise OperatorError(f"{op}: dim must be an int or None, got {dim!r}")
    return Reduction(op, x, dim, keepdim).compute(lambda i: x[i], how)


@operator("argmax")
def argmax(x, dim=None, keepdim=False):
    """Position of the first largest element along `dim` (of the flattened tensor for None)."""
    return _position("argmax", "argmax", x, dim, keepdim)


@operator("argmin")
def argmin(x, dim=None, keepdim=False):
    """Position of the first smallest element along `dim` (of the flattened tensor for None)."""
    return _position("argmin", "argmin", x, dim, keepdim)


def _values_and_positions(op: str, how: str, x, dim, keepdim):
    if not isinstance(dim, int):
        raise OperatorError(f"{op}: dim must be an int, got {dim!r}")
    red = Reduction(op, x, dim, keepdim)
    return red.compute(lambda i: x[i], how, x.dtype), red.compute(lambda i: x[i], "arg" + how)


@operator("max_dim")
def max_dim(x, dim, keepdim=False):
    """(values, indices) of the largest elements along `dim`, as torch.max(x, dim)."""
    return _values_and_positions("max_dim", "max", x, dim, keepdim)


@operator("min_dim")
def min_dim(x, dim, keepdim=False):
    """(values, indices) of the smallest elements along `dim`, as torch.min(x, dim)."""
    return _values_and_positions("min_dim", "min", x, dim, keepdim)


def _variance(op: str, x, dim, correction, keepdim, unbiased, finish):
    require_float(op, x.dtype)
    if unbiased is not None:
        correction = int(bool(unbiased))
    acc = accumulator_type(x.dtype)
    red = Reduction(op, x, dim, keepdim)
    _, variance = moments(red.shape, red.extents, lambda s, r: cast(x[red.index(s, r)], acc), acc, correction)
    return compute(red.shape, lambda *s: finish(variance[s]), dtype=x.dtype)


@operator("var")
def var(x, dim=None, correction=1, keepdim=False, unbiased=None):
    """Variance over `dim`, dividing by count - `correction` (`unbiased` sets correction 1 or 0)."""
    return _variance("var", x, dim, correction, keepdim, unbiased, lambda v: v)


@operator("std")
def std(x, dim=None, correction=1, keepdim=False, unbiased=None):
    """Standard deviation over `dim`: the square root of `var`."""
    return _variance("std", x, dim, correction, keepdim, unbiased, sqrt)


def _truth(op: str, how: str, x, dim, keepdim):
    out = dtypes.uint8 if x.dtype == dtypes.uint8 else dtypes.boolean
    red = Reduction(op, x, dim, keepdim)
    return red.compute(lambda i: ne(x[i], 0), how, dtypes.boolean, dtype=out)


@operator("all")
def all_(x, dim=None, keepdim=False):
    """Whether every element over `dim` is nonzero (bool; uint8 for uint8 input, as PyTorch)."""
    return _truth("all", "min", x, dim, keepdim)


@operator("any")
def any_(x, dim=None, keepdim=False):
    """Whether some element over `dim` is nonzero (bool; uint8 for uint8 input, as PyTorch)."""
    return _truth("any", "max", x, dim, keepdim)


@operator("cumsum")
def cumsum(x, dim, dtype=None):
    """Cumulative sum along `dim`; integers and bools accumulate to int64."""
    out = _sum_type(x, dtype)
    acc = accumulator_type(out)
    d = normalize_dim("cumsum", dim, x.ndim)
    if x.ndim == 0:
        return compute((), lambda: cast(x[()], acc), dtype=out)

    def element(*i):
        return reduce([i[d] + 1], lambda r: cast(x[i[:d] + (r,) + i[d + 1:]], acc), dtype=acc)

    return compute(x.shape, element, dtype=out)
