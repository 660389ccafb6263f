"""Element-wise math beyond the basics (the operators of kiln_ops_builtin.special) and the
composites built on them: logsumexp, isclose, xlogy, sinc, float_power."""
import math

import torch

from kiln import ops
from kiln.frontend.torch import register_function, register_method

from kiln_mappings_builtin.common import direct, is_tensor
from kiln_mappings_builtin.elementwise import _torch_functions

SPECIAL = ("asin", "acos", "atan", "sinh", "cosh", "asinh", "acosh", "atanh", "log10", "exp2",
           "erfc", "erfinv", "lgamma", "digamma", "logit", "frac", "hypot", "copysign", "fmax",
           "fmin", "logaddexp", "logaddexp2", "nan_to_num")
ALIASES = {"arcsin": "asin", "arccos": "acos", "arctan": "atan", "arcsinh": "asinh",
           "arccosh": "acosh", "arctanh": "atanh", "psi": "digamma", "gammaln": "lgamma",
           "arctan2": "atan2"}

for _name in SPECIAL:
    direct(_name, _torch_functions(_name), [_name])
for _alias, _op in ALIASES.items():
    direct(_op, _torch_functions(_alias), [_alias])


@register_function(torch.logsumexp, torch.special.logsumexp)
@register_method("logsumexp")
def logsumexp(input, dim=None, keepdim=False, *, out=None):
    """log(sum(exp(x))) over `dim`, shifted by the maximum (an infinite maximum shifts by 0)."""
    dim = tuple(range(input.ndim)) if dim is None or dim == () else dim
    if not input.dtype.is_float:
        input = ops.cast(input, torch.float32)
    high = ops.amax(input, dim, True)
    shift = ops.where(ops.isinf(high), 0.0, high)
    total = ops.log(ops.sum(ops.exp(ops.sub(input, shift)), dim, True))
    result = ops.add(total, shift)
    return result if keepdim else ops.squeeze(result, dim)


@register_function(torch.isclose)
@register_method("isclose")
def isclose(input, other, rtol=1e-05, atol=1e-08, equal_nan=False):
    """|x - y| <= atol + rtol * |y|, or x == y (infinities), or both NaN with `equal_nan`."""
    if not input.dtype.is_float and (not is_tensor(other) or not other.dtype.is_float):
        return ops.eq(input, other)
    close = ops.le(ops.abs(ops.sub(input, other)), ops.add(ops.mul(ops.abs(other), rtol), atol))
    close = ops.logical_or(ops.eq(input, other), ops.logical_and(close, ops.isfinite(ops.sub(input, other))))
    if equal_nan:
        close = ops.logical_or(close, ops.logical_and(ops.isnan(input), ops.isnan(other)))
    return close


@register_function(torch.xlogy, torch.special.xlogy)
@register_method("xlogy")
def xlogy(input, other):
    """x * log(y), 0 where x is 0 (unless y is NaN)."""
    product = ops.mul(input, ops.log(other))
    zero = ops.logical_and(ops.eq(input, 0), ops.logical_not(ops.isnan(ops.mul(other, 1.0))))
    return ops.where(zero, 0.0, product)


@register_function(torch.sinc, torch.special.sinc)
@register_method("sinc")
def sinc(input):
    """sin(pi x) / (pi x), 1 at 0."""
    scaled = ops.mul(input, math.pi)
    return ops.where(ops.eq(input, 0), 1.0, ops.div(ops.sin(scaled), scaled))

