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



@register_function(torch.deg2rad)
@register_method("deg2rad")
def deg2rad(input):
    return ops.mul(input, math.pi / 180)


@register_function(torch.rad2deg)
@register_method("rad2deg")
def rad2deg(input):
    return ops.mul(input, 180 / math.pi)


@register_function(torch.sgn)
@register_method("sgn")
def sgn(input):
    """sign, for real tensors."""
    return ops.sign(input)


@register_function(torch.signbit)
@register_method("signbit")
def signbit(input):
    """Whether the sign bit is set (-0.0 included)."""
    if not input.dtype.is_float:
        return ops.lt(input, 0)
    one = ops.full((), 1.0, dtype=input.dtype, device=input.device)
    return ops.lt(ops.copysign(one, input), 0)


@register_function(torch.isposinf)
@register_method("isposinf")
def isposinf(input):
    return ops.logical_and(ops.isinf(input), ops.gt(input, 0))


@register_function(torch.isneginf)
@register_method("isneginf")
def isneginf(input):
    return ops.logical_and(ops.isinf(input), ops.lt(input, 0))


@register_function(torch.isreal)
@register_method("isreal")
def isreal(input):
    """Real tensors: every element is real."""
    return ops.full(input.shape, True, dtype=torch.bool, device=input.device)


@register_function(torch.angle)
@register_method("angle")
def angle(input):
    """Of a real number: pi where negative, 0 elsewhere, NaN kept."""
    x = input if input.dtype.is_float else ops.cast(input, torch.float32)
    return ops.where(ops.lt(x, 0), math.pi, ops.where(ops.isnan(x), x, 0.0))


@register_function(torch.heaviside)
@register_method("heaviside")
def heaviside(input, values):
    step = ops.cast(ops.gt(input, 0), input.dtype)
    return ops.where(ops.eq(input, 0), ops.cast(values, input.dtype), step)


@register_function(torch.ldexp)
@register_method("ldexp")
def ldexp(input, other):
    return ops.mul(input, ops.exp2(other))


@register_function(torch.float_power)
@register_method("float_power")
def float_power(input, exponent):
    """pow in float64."""
    input = ops.cast(input, torch.float64) if is_tensor(input) else float(input)
    exponent = ops.cast(exponent, torch.float64) if is_tensor(exponent) else float(exponent)
    return ops.pow(input, exponent)


@register_function(torch.mvlgamma, torch.special.multigammaln)
@register_method("mvlgamma")
def mvlgamma(input, p):
    """log of the multivariate gamma function of dimension p."""
    total = ops.full((), p * (p - 1) / 4 * math.log(math.pi), dtype=input.dtype, device=input.device)
    for j in range(p):
        total = ops.add(total, ops.lgamma(ops.sub(input, j / 2)))
    return total


@register_function(torch.special.ndtr)
def ndtr(input):
    """The standard normal CDF: erfc(-x / sqrt 2) / 2."""
    return ops.mul(ops.erfc(ops.mul(input, -math.sqrt(0.5))), 0.5)


@register_function(torch.special.log_ndtr)
def log_ndtr(input):
    return ops.log(ndtr(input))


@register_function(torch.special.ndtri)
def ndtri(input):
    """The inverse of ndtr: sqrt 2 * erfinv(2p - 1)."""
    return ops.mul(ops.erfinv(ops.sub(ops.mul(input, 2.0), 1.0)), math.sqrt(2))


@register_function(torch.special.erfcx)
def erfcx(input):
    """exp(x^2) erfc(x) (overflows to inf where exp(x^2) does, for x large and negative)."""
    return ops.mul(ops.exp(ops.mul(input, input)), ops.erfc(input))


@register_function(torch.special.entr)
def entr(input):
    """-x log x; 0 at 0, -inf below 0."""
    value = ops.neg(ops.mul(input, ops.log(input)))
    return ops.where(ops.lt(input, 0), float("-inf"), ops.where(ops.eq(input, 0), 0.0, value))


@register_function(torch.special.xlog1py)
def xlog1py(input, other):
    """x * log1p(y), 0 where x is 0 (unless y is NaN)."""
    product = ops.mul(input, ops.log1p(other))
    zero = ops.logical_and(ops.eq(input, 0), ops.logical_not(ops.isnan(ops.mul(other, 1.0))))
    return ops.where(zero, 0.0, product)
