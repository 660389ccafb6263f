"""Element-wise math beyond the basics: inverse trigonometric and hyperbolic functions, log10,
exp2, erfc, erfinv, lgamma, digamma, logit, frac, hypot, copysign, fmax/fmin, logaddexp and
nan_to_num.

Integers and bool give float32, as in PyTorch. The transcendental functions that PyTorch
computes to full precision but the C math library of a CUDA kernel does not offer (erfc, erfinv,
lgamma, digamma) are composed here from exp, log, erf and rational approximations, evaluated in
float64 and rounded once to the result type: float64 results are accurate to about 1e-13
relative (erfc to 1e-7 relative where x > 0.5).
"""
import math

import torch

from kiln import dtypes, ir
from kiln.graph import OperatorError, operator
from kiln.ir import cast, select

from kiln_ops_builtin.common import ANY, FLOATING, NUMERIC, elementwise_compute

F64 = dtypes.float64


def _unary(name: str, fn, doc: str, accepts=ANY, precise: bool = False):
    """The operator `name(input)`: `fn` of each element, integers and bool giving float32.
    `precise`: `fn` receives the value in float64 and its result is rounded once."""
    body = (lambda v: cast(fn(cast(v, F64)), v.dtype)) if precise else fn

    def definition(input):
        return elementwise_compute(name, (input,), body, accepts, to_float=True)
    definition.__doc__ = doc
    return operator(name)(definition)


def _binary(name: str, fn, doc: str, accepts=ANY, to_float: bool = True):
    def definition(input, other):
        return elementwise_compute(name, (input, other), fn, accepts, to_float)
    definition.__doc__ = doc
    return operator(name)(definition)


asin = _unary("asin", ir.asin, "The inverse sine.")
acos = _unary("acos", ir.acos, "The inverse cosine.")
atan = _unary("atan", ir.atan, "The inverse tangent.")
sinh = _unary("sinh", ir.sinh, "The hyperbolic sine.")
cosh = _unary("cosh", ir.cosh, "The hyperbolic cosine.")
asinh = _unary("asinh", ir.asinh, "The inverse hyperbolic sine.")
acosh = _unary("acosh", ir.acosh, "The inverse hyperbolic cosine.")
atanh = _unary("atanh", ir.atanh, "The inverse hyperbolic tangent.")
log10 = _unary("log10", lambda v: ir.log(v) * (1 / math.log(10)), "The base-10 logarithm.", precise=True)
exp2 = _unary("exp2", lambda v: ir.exp(v * math.log(2)), "2 ** x.", precise=True)
frac = _unary("frac", lambda v: v - ir.trunc(v), "x - trunc(x), keeping the sign of x.", FLOATING)


def _erfc(v):
    """1 - erf(v): directly for |v| < 0.5, else by the Chebyshev fit of Numerical Recipes'
    erfcc (relative error below 1.2e-7), which keeps its precision in the far tail."""
    z = ir.abs_(v)
    t = 1 / (1 + 0.5 * z)
    poly = -0.82215223 + t * 0.17087277
    for c in (1.48851587, -1.13520398, 0.27886807, -0.18628806, 0.09678418, 0.37409196,
              1.00002368, -1.26551223):
        poly = c + t * poly
    tail = t * ir.exp(-z * z + poly)
    return select(z < 0.5, 1 - ir.erf(v), select(v >= 0, tail, 2 - tail))


erfc = _unary("erfc", _erfc, "The complementary error function 1 - erf(x).", precise=True)


def _erfinv(y):
    """Giles' single-precision approximation, refined by two Newton steps on erf."""
    w = -ir.log((1 - y) * (1 + y))
    small, large = w - 2.5, ir.sqrt(w) - 3
    p_small, p_large = 2.81022636e-08, -0.000200214257
    for c in (3.43273939e-07, -3.5233877e-06, -4.39150654e-06, 0.00021858087, -0.00125372503,
              -0.00417768164, 0.246640727, 1.50140941):
        p_small = c + p_small * small
    for c in (0.000100950558, 0.00134934322, -0.00367342844, 0.00573950773, -0.0076224613,
              0.00943887047, 1.00167406, 2.83297682):
        p_large = c + p_large * large
    x = select(w < 5, p_small, p_large) * y
    for _ in range(2):
        x = x - (ir.erf(x) - y) / (2 / math.sqrt(math.pi) * ir.exp(-x * x))
    edge = select(y > 0, math.inf, -math.inf)
    return select(ir.abs_(y) > 1, math.nan, select(ir.eq(ir.abs_(y), 1), edge, x))


erfinv = _unary("erfinv", _erfinv, "The inverse error function (NaN outside [-1, 1]).", precise=True)

_LANCZOS_G = 7
_LANCZOS = (0.99999999999980993, 676.5203681218851, -1259.1392167224028, 771.32342877765313,
            -176.61502916214059, 12.507343278686905, -0.13857109526572012, 9.9843695780195716e-6,
            1.5056327351493116e-7)


def _lgamma_positive(x):
    """log|Gamma(x)| for x >= 0.5 by the Lanczos approximation (g = 7, 9 terms)."""
    z = x - 1
    series = _LANCZOS[0]
    for k, c in enumerate(_LANCZOS[1:], start=1):
        series = series + c / (z + k)
    t = z + _LANCZOS_G + 0.5
    return 0.5 * math.log(2 * math.pi) + (z + 0.5) * ir.log(t) - t + ir.log(series)


def _lgamma(x):
    """log|Gamma(x)|: Lanczos for x >= 0.5, the reflection formula below; +inf at the poles."""
    reflected = math.log(math.pi) - ir.log(ir.abs_(ir.sin(math.pi * x))) - _lgamma_positive(1 - x)
    pole = (x <= 0) & ir.eq(x, ir.floor(x))
    value = select(x < 0.5, reflected, _lgamma_positive(select(x < 0.5, 1.0, x)))
    return select(pole | ir.isinf(x), math.inf, value)


lgamma = _unary("lgamma", _lgamma, "The log of the absolute value of the gamma function.", precise=True)


def _digamma_positive(x):
    """psi(x) for x >= 0.5: six recurrence steps up, then the asymptotic series."""
    shift = 0.0
    for k in range(6):
        shift = shift + 1 / (x + k)
    y = x + 6
    inv2 = 1 / (y * y)
    series = inv2 * (1 / 12 - inv2 * (1 / 120 - inv2 * (1 / 252 - inv2 * (1 / 240 - inv2 / 132))))
    return ir.log(y) - 0.5 / y - series - shift


def _digamma(x):
    """psi(x) = d/dx log Gamma(x): reflection below 0.5; -inf at 0, NaN at negative integers."""
    safe = select(x < 0.5, 1 - x, x)
    value = _digamma_positive(safe)
    reflected = value - math.pi / ir.tan(math.pi * x)
    result = select(x < 0.5, reflected, value)
    return select(ir.eq(x, 0), -math.inf, select((x < 0) & ir.eq(x, ir.floor(x)), math.nan, result))


digamma = _unary("digamma", _digamma, "The digamma function, psi(x).", precise=True)


@operator("logit")
def logit(input, eps=None):
    """log(p / (1 - p)), with p clamped to [eps, 1 - eps] when eps is given."""
    def fn(v):
        if eps is not None:
            v = ir.minimum(ir.maximum(v, eps), 1 - eps)
        return ir.log(v / (1 - v))
    return elementwise_compute("logit", (input,), fn, ANY, to_float=True)


def _copysign(a, b):
    negative = (b < 0) | (ir.eq(b, 0) & (1 / b < 0))  # -0.0 counts as negative
    return select(negative, -ir.abs_(a), ir.abs_(a))


def _fmax(a, b):
    return select(ir.isnan(a), b, select(ir.isnan(b), a, ir.maximum(a, b)))


def _fmin(a, b):
    return select(ir.isnan(a), b, select(ir.isnan(b), a, ir.minimum(a, b)))


def _logaddexp(scale: float):
    """log(e^a + e^b) (scale 1) or log2(2^a + 2^b) (scale ln 2), stable for large |a - b|."""
    def fn(a, b):
        high = ir.maximum(a, b)
        spread = -ir.abs_(a - b) * scale
        return select(ir.eq(a, b), a + math.log(2) / scale, high + ir.log1p(ir.exp(spread)) / scale)
    return fn


def _hypot(a, b):
    """Scaled by the larger magnitude, so it neither overflows nor underflows; an infinite
    operand gives inf even beside a NaN (C's hypot)."""
    high, low = ir.maximum(ir.abs_(a), ir.abs_(b)), ir.minimum(ir.abs_(a), ir.abs_(b))
    ratio = low / select(ir.eq(high, 0), 1.0, high)
    value = high * ir.sqrt(1 + ratio * ratio)
    return select(ir.isinf(a) | ir.isinf(b), math.inf, value)


hypot = _binary("hypot", _hypot, "sqrt(x ** 2 + y ** 2).", FLOATING)
copysign = _binary("copysign", _copysign, "|x| with the sign of y (-0.0 counts as negative).")
fmax = _binary("fmax", _fmax, "The larger of x and y, ignoring a NaN operand.", NUMERIC, to_float=False)
fmin = _binary("fmin", _fmin, "The smaller of x and y, ignoring a NaN operand.", NUMERIC, to_float=False)
logaddexp = _binary("logaddexp", _logaddexp(1.0), "log(exp(x) + exp(y)).", FLOATING)
logaddexp2 = _binary("logaddexp2", _logaddexp(math.log(2)), "log2(2 ** x + 2 ** y).", FLOATING)


@operator("nan_to_num")
def nan_to_num(input, nan=0.0, posinf=None, neginf=None):
    """NaN replaced by `nan`, +inf by `posinf` and -inf by `neginf` (by default the largest and
    smallest finite values of the type); integers and bool are unchanged."""
    if not input.dtype.is_float:
        return elementwise_compute("nan_to_num", (input,), lambda v: v, ANY)
    finfo = torch.finfo(input.dtype.torch_dtype)
    high = finfo.max if posinf is None else posinf
    low = finfo.min if neginf is None else neginf
    for name, value in (("nan", nan), ("posinf", high), ("neginf", low)):
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise OperatorError(f"nan_to_num: {name} must be a number, got {value!r}")

    def fn(v):
        typed = [cast(cast(value, input.dtype), v.dtype) for value in (nan, high, low)]
        return select(ir.isnan(v), typed[0], select(ir.isinf(v), select(v > 0, typed[1], typed[2]), v))

    return elementwise_compute("nan_to_num", (input,), fn, FLOATING)
