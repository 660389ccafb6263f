"""Cumulative operators along one dim: cumprod, cummax, cummin and logcumsumexp.

Element i reduces the prefix 0..i of its row (O(n^2) work per row of length n, fully parallel),
as `cumsum` does; 16-bit floats accumulate in float32.
"""
from kiln import dtypes, ir
from kiln.graph import operator
from kiln.ir import cast, compute, reduce, select

from kiln_ops_builtin.common import accumulator_type, normalize_dim


def _prefix(x, d: int, i, body, how: str, acc):
    """The `how`-reduction of body(element) over the prefix 0..i[d] of `x`'s row."""
    return reduce([i[d] + 1], lambda r: body(x[[r if k == d else v for k, v in enumerate(i)]]), how, acc)


@operator("cumprod")
def cumprod(x, dim, dtype=None):
    """Cumulative product along `dim`; integers and bools multiply to int64."""
    out = dtypes.data_type(dtype) if dtype is not None else (x.dtype if x.dtype.is_float else dtypes.int64)
    acc = accumulator_type(out)
    d = normalize_dim("cumprod", dim, x.ndim)
    if x.ndim == 0:
        return compute((), lambda: cast(x[()], out))
    return compute(x.shape, lambda *i: _prefix(x, d, i, lambda v: cast(v, acc), "prod", acc), dtype=out)


def _running_extreme(op: str, how: str, x, dim):
    """(values, int64 indices): the running extreme and the last position holding it; a NaN
    is the extreme from where it appears on, as in PyTorch."""
    d = normalize_dim(op, dim, x.ndim)
    if x.ndim == 0:
        return compute((), lambda: x[()]), compute((), lambda: cast(0, dtypes.int64))
    values = compute(x.shape, lambda *i: _prefix(x, d, i, lambda v: v, how, x.dtype))

    def position(*i):
        def holds(r):
            v = x[[r if k == d else c for k, c in enumerate(i)]]
            same = ir.eq(v, values[i])
            if x.dtype.is_float:
                same = same | (ir.isnan(v) & ir.isnan(values[i]))
            return select(same, r, -1)
        return reduce([i[d] + 1], holds, "max", dtypes.int64)

    return values, compute(x.shape, position)


@operator("cummax")
def cummax(x, dim):
    """(values, indices) of the running maximum along `dim`."""
    return _running_extreme("cummax", "max", x, dim)


@operator("cummin")
def cummin(x, dim):
    """(values, indices) of the running minimum along `dim`."""
    return _running_extreme("cummin", "min", x, dim)


@operator("logcumsumexp")
def logcumsumexp(x, dim):
    """log(cumsum(exp(x))) along `dim`, computed stably (shifted by the running maximum)."""
    d = normalize_dim("logcumsumexp", dim, x.ndim)
    acc = accumulator_type(x.dtype)
    if x.ndim == 0:
        return compute((), lambda: x[()])
    high = compute(x.shape, lambda *i: _prefix(x, d, i, lambda v: cast(v, acc), "max", acc))

    def element(*i):
        shift = select(ir.isinf(high[i]), 0.0, high[i])
        total = _prefix(x, d, i, lambda v: ir.exp(cast(v, acc) - shift), "sum", acc)
        return ir.log(total) + shift

    return compute(x.shape, element, dtype=x.dtype)
