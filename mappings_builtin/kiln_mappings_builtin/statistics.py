"""Reductions and statistics composed from the basic ones: aminmax, nanmean, nansum,
count_nonzero, dist, trace, renorm, the trapezoid rules, isin, bucketize and
searchsorted (counting comparisons), histc (counting per bin), quantile and nanquantile
(sorting)."""
import math

import torch

from kiln import ops
from kiln.frontend.torch import register_function, register_method

from kiln_mappings_builtin.common import counted, is_tensor, no_out
from kiln_mappings_builtin.products import _p_norm


@register_function(torch.aminmax, check=no_out)
@register_method("aminmax")
def aminmax(input, *, dim=None, keepdim=False, out=None):
    return ops.amin(input, dim, keepdim), ops.amax(input, dim, keepdim)


@register_function(torch.nansum, check=no_out)
@register_method("nansum")
def nansum(input, dim=None, keepdim=False, *, dtype=None, out=None):
    clean = ops.where(ops.isnan(input), 0, input) if input.dtype.is_float else input
    return ops.sum(clean, dim, keepdim, dtype)


@register_function(torch.nanmean, check=no_out)
@register_method("nanmean")
def nanmean(input, dim=None, keepdim=False, *, dtype=None, out=None):
    present = ops.logical_not(ops.isnan(input))
    total = nansum(input, dim, keepdim, dtype=dtype)
    return ops.div(total, ops.sum(present, dim, keepdim))


@register_function(torch.count_nonzero)
@register_method("count_nonzero")
def count_nonzero(input, dim=None):
    return ops.sum(ops.ne(input, 0), dim)


@register_function(torch.dist)
@register_method("dist")
def dist(input, other, p=2):
    diff = ops.sub(input, other)
    return _p_norm(ops.reshape(diff, (-1,)), p, 0)


@register_function(torch.trace)
@register_method("trace")
def trace(input):
    n = min(input.shape)
    eye = ops.reshape(ops.eq(ops.arange(n, device=input.device),
                             ops.reshape(ops.arange(n, device=input.device), (n, 1))), (n, n))
    square = ops.slice(ops.slice(input, 0, 0, n), 1, 0, n)
    return ops.sum(ops.where(eye, square, 0), dtype=None if input.dtype.is_float else torch.int64)


@register_function(torch.renorm)
@register_method("renorm")
def renorm(input, p, dim, maxnorm):
    """Each slice along `dim` whose p-norm exceeds maxnorm rescaled to norm maxnorm."""
    others = [k for k in range(input.ndim) if k != dim % input.ndim]
    norm = _p_norm(input, p, others, True)
    scale = ops.where(ops.gt(norm, maxnorm), ops.div(maxnorm, ops.add(norm, 1e-7)), 1.0)
    return ops.mul(input, scale)


def _trapezoids(y, x=None, dx=None, dim=-1):
    n = y.shape[dim]
    mean = ops.mul(ops.add(ops.slice(y, dim, 1, n), ops.slice(y, dim, 0, n - 1)), 0.5)
    if is_tensor(x):
        xd = dim if x.ndim > 1 else 0
        return ops.mul(mean, ops.sub(ops.slice(x, xd, 1, None), ops.slice(x, xd, 0, -1)))
    spacing = dx if dx is not None else (x if x is not None else 1)
    return mean if spacing == 1 else ops.mul(mean, spacing)


@register_function(torch.trapezoid, torch.trapz)
def trapezoid(y, x=None, *, dx=None, dim=-1):
    return ops.sum(_trapezoids(y, x, dx, dim), dim)


@register_function(torch.cumulative_trapezoid)
def cumulative_trapezoid(y, x=None, *, dx=None, dim=-1):
    return ops.cumsum(_trapezoids(y, x, dx, dim), dim)


@register_function(torch.isin, check=lambda elements, test_elements, **k: is_tensor(elements))
def isin(elements, test_elements, *, assume_unique=False, invert=False):
    tests = ops.reshape(test_elements, (-1,)) if is_tensor(test_elements) else test_elements
    if not is_tensor(tests):
        found = ops.eq(elements, tests)
    else:
        found = ops.any(ops.eq(ops.unsqueeze(elements, -1), tests), -1)
    return ops.logical_not(found) if invert else found


@register_function(torch.bucketize, check=lambda input, boundaries, **k: is_tensor(input))
def bucketize(input, boundaries, *, out_int32=False, right=False, out=None):
    return counted(boundaries, input, right, torch.int32 if out_int32 else torch.int64)


def _sorted_plain(sorted_sequence, input, *args, **kwargs) -> bool:
    return is_tensor(input)


@register_function(torch.searchsorted, check=_sorted_plain)
def searchsorted(sorted_sequence, input, *, out_int32=False, right=False, side=None, out=None, sorter=None):
    right = right or side == "right"
    if sorter is not None and sorter.numel():
        sorted_sequence = ops.take_along_dim(sorted_sequence, sorter, -1)
    return counted(sorted_sequence, input, right, torch.int32 if out_int32 else torch.int64)


def _at_rank(moved, rank, n: int):
    """moved[.., 0, rank[.., q]] for the float ranks (whole numbers) `rank` of shape (.., Q)."""
    index = ops.cast(ops.clamp(rank, 0, n - 1), torch.int64)
    return ops.take_along_dim(ops.squeeze(moved, -2), index, -1)


def _quantile(input, q, dim, keepdim, interpolation, ignore_nan: bool):
    """PyTorch's quantile on the sorted values (NaN sorts last)."""
    if dim is None or input.ndim == 0:
        input, dim, keepdim = ops.reshape(input, (-1,)), 0, keepdim and input.ndim > 0
    d = dim % max(input.ndim, 1)
    values = ops.sort(input, d)[0]
    scalar_q = not is_tensor(q)
    qs = ops.reshape(ops.full((), q, dtype=input.dtype, device=input.device) if scalar_q else q, (-1,))
    n = input.shape[d]
    moved = ops.unsqueeze(ops.transpose(values, d, -1) if d != input.ndim - 1 else values, -2)  # (.., 1, n)
    count = ops.sum(ops.logical_not(ops.isnan(moved)), -1) if ignore_nan else n
    rank = ops.mul(qs, ops.sub(count, 1) if ignore_nan else n - 1)  # (.., Q)
    low, high = ops.floor(rank), ops.ceil(rank)
    if interpolation == "lower":
        high = low
    elif interpolation == "higher":
        low = high
    elif interpolation == "nearest":
        low = high = ops.round(rank)
    lo_v, hi_v = _at_rank(moved, low, n), _at_rank(moved, high, n)
    if interpolation == "midpoint":
        result = ops.mul(ops.add(lo_v, hi_v), 0.5)
    elif interpolation == "linear":
        result = ops.add(lo_v, ops.mul(ops.sub(hi_v, lo_v), ops.sub(rank, low)))
    else:
        result = lo_v
    if not ignore_nan:
        has_nan = ops.any(ops.isnan(moved), -1)
        result = ops.where(has_nan, float("nan"), result)
    # result: (.., Q) over the other dims; PyTorch puts Q first
    result = ops.permute(result, [result.ndim - 1] + list(range(result.ndim - 1)))
    if keepdim:
        result = ops.unsqueeze(result, d + 1)
    return ops.squeeze(result, 0) if scalar_q else result


def _quantile_rule(ignore_nan: bool):
    def rule(input, q, dim=None, keepdim=False, *, interpolation="linear", out=None):
        return _quantile(input, q, dim, keepdim, interpolation, ignore_nan)
    rule.__name__ = rule.__qualname__ = "nanquantile" if ignore_nan else "quantile"
    return rule


quantile = register_function(torch.quantile, check=no_out)(register_method("quantile")(_quantile_rule(False)))
nanquantile = register_function(torch.nanquantile, check=no_out)(
    register_method("nanquantile")(_quantile_rule(True)))


def histc_supported(input, bins=100, min=0, max=0, *, out=None) -> bool:
    """Float input, a range eager accepts (finite, min <= max; min == max takes the data's)."""
    return (out is None and input.dtype.is_float and math.prod(input.shape) > 0 and isinstance(bins, int)
            and bins > 0 and math.isfinite(min) and math.isfinite(max) and min <= max)


@register_function(torch.histc, check=histc_supported)
@register_method("histc", check=histc_supported)
def histc(input, bins=100, min=0, max=0, *, out=None):
    """As eager's CPU kernel: edges min and max in the input's dtype (the data's extremes where
    min == max, widened by 1 where those are equal too), element e in bin
    trunc((e - min) * bins / (max - min)), max in the last bin, NaN and values outside ignored;
    each bin counts its elements (a comparison per element and bin, no atomics)."""
    x = ops.reshape(input, (-1,))
    if min == max:
        low, high = ops.amin(x), ops.amax(x)
        same = ops.eq(low, high)
        low, high = ops.where(same, ops.sub(low, 1), low), ops.where(same, ops.add(high, 1), high)
    else:
        low, high = (ops.full((), v, dtype=input.dtype, device=input.device) for v in (min, max))
    position = ops.div(ops.mul(ops.sub(x, low), bins), ops.sub(high, low))
    position = ops.minimum(ops.cast(position, "int64"), bins - 1)
    inside = ops.logical_and(ops.ge(x, low), ops.le(x, high))
    bin_index = ops.reshape(ops.arange(bins, device=input.device), (bins, 1))
    counted = ops.logical_and(ops.eq(position, bin_index), inside)
    return ops.sum(ops.cast(counted, input.dtype), 1)
