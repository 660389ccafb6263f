"""Element-wise math operators with PyTorch's broadcasting and type promotion.

Most operators here are one scalar function applied by `elementwise_compute`: their operands
may be tensors or Python scalars, they broadcast together, and 16-bit floats compute in float32.
"""
import operator as python

from kiln import dtypes, ir
from kiln.graph import OperatorError, Role, Traits, operator
from kiln.ir import TensorNode, cast, compute, select

from kiln_ops_builtin.common import (ANY, INTEGER, INTEGRAL, NUMERIC, accumulator_type, broadcast_shape,
                                     check_dtype, elementwise_compute, logistic, operand_value, result_type)


def _unary(name: str, fn, doc: str, accepts=NUMERIC, to_float: bool = False, dtype=None, implements=None):
    """The operator `name(input)` computing `fn` of each element (implementing the Python
    operator `implements`, if given)."""
    def definition(input):
        return elementwise_compute(name, (input,), fn, accepts, to_float, dtype)
    definition.__doc__ = doc
    return operator(name, traits=Traits(implements=implements))(definition)


def _binary(name: str, fn, doc: str, accepts=ANY, to_float: bool = False, dtype=None, implements=None,
            exact_scalars: bool = False):
    """The operator `name(input, other)` computing `fn` of each pair of broadcast elements
    (implementing the Python operator `implements`, if given; `exact_scalars`: see
    `elementwise_compute`)."""
    def definition(input, other):
        return elementwise_compute(name, (input, other), fn, accepts, to_float, dtype, exact_scalars)
    definition.__doc__ = doc
    return operator(name, traits=Traits(implements=implements))(definition)


# ---------------------------------------------------------------- unary math

abs_ = _unary("abs", ir.abs_, "|x|, keeping integer types.", implements=python.abs)
neg = _unary("neg", lambda v: -v, "-x, keeping integer types (unsigned ones wrap).", implements=python.neg)
sign = _unary("sign", ir.sign, "-1, 0 or 1 by the sign of x, in x's type.", ANY)
floor = _unary("floor", ir.floor, "The largest integer <= x (integers unchanged).")
ceil = _unary("ceil", ir.ceil, "The smallest integer >= x (integers unchanged).")
trunc = _unary("trunc", ir.trunc, "x rounded toward zero (integers unchanged).")
exp = _unary("exp", ir.exp, "e ** x (integers and bool give float32).", ANY, to_float=True)
expm1 = _unary("expm1", ir.expm1, "e ** x - 1, accurate near 0.", ANY, to_float=True)
log = _unary("log", ir.log, "The natural logarithm.", ANY, to_float=True)
log1p = _unary("log1p", ir.log1p, "log(1 + x), accurate near 0.", ANY, to_float=True)
log2 = _unary("log2", ir.log2, "The base-2 logarithm.", ANY, to_float=True)
sqrt = _unary("sqrt", ir.sqrt, "The square root.", ANY, to_float=True)
rsqrt = _unary("rsqrt", ir.rsqrt, "1 / sqrt(x).", ANY, to_float=True)
sin = _unary("sin", ir.sin, "The sine.", ANY, to_float=True)
cos = _unary("cos", ir.cos, "The cosine.", ANY, to_float=True)
tan = _unary("tan", ir.tan, "The tangent.", ANY, to_float=True)
tanh = _unary("tanh", ir.tanh, "The hyperbolic tangent.", ANY, to_float=True)
erf = _unary("erf", ir.erf, "The error function.", ANY, to_float=True)
reciprocal = _unary("reciprocal", lambda v: 1 / v, "1 / x.", ANY, to_float=True)
isnan = _unary("isnan", ir.isnan, "Whether x is NaN.", ANY, dtype=dtypes.boolean)
isinf = _unary("isinf", ir.isinf, "Whether x is +-infinity.", ANY, dtype=dtypes.boolean)
isfinite = _unary("isfinite", lambda v: ir.logical_not(ir.isnan(v) | ir.isinf(v)),
                  "Whether x is neither NaN nor infinite.", ANY, dtype=dtypes.boolean)
logical_not = _unary("logical_not", ir.logical_not, "x == 0, as bool.", ANY, dtype=dtypes.boolean)
bitwise_not = _unary("bitwise_not", lambda v: ~v, "~x; logical not for bool.", INTEGRAL, implements=python.invert)


@operator("sigmoid")
def sigmoid(input):
    """1 / (1 + e ** -x) (integers and bool give float32)."""
    return elementwise_compute("sigmoid", (input,), lambda v: logistic(v, input.dtype), ANY, to_float=True)


@operator("round")
def round_(input, decimals: int = 0):
    """x rounded to `decimals` decimal places, halves to even (integers unchanged at 0)."""
    if not isinstance(decimals, int):
        raise OperatorError(f"round: decimals must be an int, got {decimals!r}")
    if decimals == 0:
        return elementwise_compute("round", (input,), ir.round_even, NUMERIC)
    if not input.dtype.is_float:
        raise OperatorError(f"round: decimals={decimals} needs a floating-point input, got {input.dtype}")
    scale = 10.0 ** (decimals if decimals > 0 else -decimals)
    if decimals > 0:
        return elementwise_compute("round", (input,), lambda v: ir.round_even(v * scale) / scale)
    return elementwise_compute("round", (input,), lambda v: ir.round_even(v / scale) * scale)


# ---------------------------------------------------------------- binary arithmetic

def _scaled(name: str, combine, input, other, alpha):
    """`combine(x, alpha * y)`; alpha takes the result type (a float alpha needs float operands).
    With 16-bit floats, a Python scalar operand and alpha enter unrounded, in float32 (as
    PyTorch's CUDA kernels take them; see `elementwise_compute`)."""
    t = result_type(input, other, op=name)
    if isinstance(alpha, float) and not t.is_float:
        raise OperatorError(f"{name}: alpha={alpha!r} is a float, but the operands are of type {t}")
    if alpha == 1:
        return elementwise_compute(name, (input, other), combine, exact_scalars=True)
    scale = cast(alpha if t in dtypes.HALF_FLOATS else cast(alpha, t), accumulator_type(t))
    return elementwise_compute(name, (input, other), lambda a, b: combine(a, scale * b), exact_scalars=True)


@operator("add", traits=Traits(implements=python.add))
def add(input, other, alpha=1):
    """x + alpha * y (for bool: logical or)."""
    return _scaled("add", lambda a, b: a + b, input, other, alpha)


@operator("sub", traits=Traits(implements=python.sub))
def sub(input, other, alpha=1):
    """x - alpha * y (not for two bools: use logical_xor)."""
    if result_type(input, other, op="sub").is_bool:
        raise OperatorError("sub: subtracting bool operands is not supported; use logical_xor")
    return _scaled("sub", lambda a, b: a - b, input, other, alpha)


mul = _binary("mul", lambda a, b: a * b, "x * y (for bool: logical and; a Python scalar times 16-bit floats "
              "enters unrounded, in float32, as PyTorch's CUDA kernels take it).", implements=python.mul,
              exact_scalars=True)


def _integer_divisor(name: str, fn):
    """`fn(a, b)` for a division-like operator: an integer divisor of zero fails the kernel with
    ZeroDivisionError, as PyTorch raises on the CPU (floats give inf or NaN)."""
    def checked(a, b):
        if b.dtype.is_float:
            return fn(a, b)
        return fn(a, ir.check(ir.ne(b, 0), b, "ZeroDivisionError", f"{name}: integer division by zero"))
    return checked


def _rounded_div(name: str, input, other, rounding_mode: str):
    """x / y rounded toward zero ('trunc') or down ('floor'), keeping integer types."""
    if rounding_mode == "floor":
        return elementwise_compute(name, (input, other), _integer_divisor(name, lambda a, b: a // b), NUMERIC)
    t = result_type(input, other, op=name)

    def trunc_div(a, b):
        if not t.is_float:
            return _integer_divisor(name, lambda a, b: a / b)(a, b)  # integer division truncates
        # PyTorch rounds the quotient to the operands' type (16-bit too) before truncating it.
        return ir.trunc(cast(cast(a / b, t), a.dtype))

    return elementwise_compute(name, (input, other), trunc_div, NUMERIC)


@operator("div", traits=Traits(implements=python.truediv))
def div(input, other, rounding_mode=None):
    """x / y. rounding_mode None: true division (integers give float32); 'trunc': rounded toward
    zero; 'floor': rounded down (both keep the integer type)."""
    if rounding_mode is None:
        return elementwise_compute("div", (input, other), lambda a, b: a / b, to_float=True, exact_scalars=True)
    if rounding_mode not in ("trunc", "floor"):
        raise OperatorError(f"div: rounding_mode must be None, 'trunc' or 'floor', got {rounding_mode!r}")
    return _rounded_div("div", input, other, rounding_mode)


@operator("floor_divide", traits=Traits(implements=python.floordiv))
def floor_divide(input, other):
    """x / y rounded down: div with rounding_mode='floor'."""
    return _rounded_div("floor_divide", input, other, "floor")


_POWERS_AS_PRODUCTS = {2: lambda a, b: a * a, 3: lambda a, b: a * a * a}


@operator("pow", traits=Traits(implements=python.pow))
def pow_(input, other):
    """x ** y (an integer base with a negative Python int exponent is an error, as in PyTorch).
    A Python exponent of 2 or 3 is x * x or x * x * x, as PyTorch computes them (exact where the
    math library's pow is not, and an order of magnitude cheaper: RMSNorm's mean of squares,
    GELU's tanh approximation)."""
    t = result_type(input, other, op="pow")
    if isinstance(other, int) and other < 0 and not t.is_float:
        raise OperatorError(f"pow: integers to negative integer powers are not allowed "
                            f"(result type {t}, exponent {other})")
    if isinstance(other, (int, float)) and not isinstance(other, bool) and other in _POWERS_AS_PRODUCTS:
        return elementwise_compute("pow", (input, other), _POWERS_AS_PRODUCTS[other], NUMERIC)
    return elementwise_compute("pow", (input, other), lambda a, b: a ** b, NUMERIC)


remainder = _binary("remainder", _integer_divisor("remainder", lambda a, b: a % b),
                    "x modulo y with the sign of y (Python's %).", NUMERIC, implements=python.mod)
fmod = _binary("fmod", _integer_divisor("fmod", ir.fmod), "x modulo y with the sign of x (C's fmod).", NUMERIC)
atan2 = _binary("atan2", ir.atan2, "The angle of the point (y=x, x=other).", ANY, to_float=True)
maximum = _binary("maximum", ir.maximum, "The larger of x and y (NaN if either is NaN).")
minimum = _binary("minimum", ir.minimum, "The smaller of x and y (NaN if either is NaN).")

# ---------------------------------------------------------------- comparisons and logic

eq = _binary("eq", ir.eq, "x == y, as bool.", dtype=dtypes.boolean, implements=python.eq)
ne = _binary("ne", ir.ne, "x != y, as bool.", dtype=dtypes.boolean, implements=python.ne)
lt = _binary("lt", lambda a, b: a < b, "x < y, as bool.", dtype=dtypes.boolean, implements=python.lt)
le = _binary("le", lambda a, b: a <= b, "x <= y, as bool.", dtype=dtypes.boolean, implements=python.le)
gt = _binary("gt", lambda a, b: a > b, "x > y, as bool.", dtype=dtypes.boolean, implements=python.gt)
ge = _binary("ge", lambda a, b: a >= b, "x >= y, as bool.", dtype=dtypes.boolean, implements=python.ge)
logical_and = _binary("logical_and", ir.logical_and, "x and y (nonzero is true), as bool.",
                      dtype=dtypes.boolean)
logical_or = _binary("logical_or", ir.logical_or, "x or y (nonzero is true), as bool.",
                     dtype=dtypes.boolean)
logical_xor = _binary("logical_xor", lambda a, b: ir.ne(cast(a, "bool"), cast(b, "bool")),
                      "Exactly one of x and y is nonzero, as bool.", dtype=dtypes.boolean)
bitwise_and = _binary("bitwise_and", lambda a, b: a & b, "x & y on integers and bool.", INTEGRAL,
                      implements=python.and_)
bitwise_or = _binary("bitwise_or", lambda a, b: a | b, "x | y on integers and bool.", INTEGRAL,
                     implements=python.or_)
bitwise_xor = _binary("bitwise_xor", lambda a, b: a ^ b, "x ^ y on integers and bool.", INTEGRAL,
                      implements=python.xor)


def _shift_left(a, b):
    out_of_range = (b < 0) | (b >= 8 * a.dtype.nbytes)
    return select(out_of_range, 0, ir.shift_left(a, b))


def _shift_right(a, b):
    bits = 8 * a.dtype.nbytes
    fill = 0 if a.dtype.kind == "uint" else ir.shift_right(a, bits - 1)
    return select((b < 0) | (b >= bits), fill, ir.shift_right(a, b))


bitwise_left_shift = _binary("bitwise_left_shift", _shift_left,
                             "x << y; 0 where y is negative or not less than x's width.", INTEGER)
bitwise_right_shift = _binary("bitwise_right_shift", _shift_right,
                              "x >> y (arithmetic for signed types); y out of [0, width) gives "
                              "the sign fill.", INTEGER)


# ---------------------------------------------------------------- selection and conversion

@operator("where")
def where(condition, input, other):
    """`input` where the bool `condition` holds, else `other`; all three broadcast, and input and
    other (tensors or Python scalars) promote together."""
    if not isinstance(condition, TensorNode):
        raise OperatorError(f"where: condition must be a bool tensor, got {condition!r}")
    check_dtype("where", condition, (dtypes.boolean,), "bool")
    t = result_type(input, other, op="where")
    operands = (condition, input, other)
    shape = broadcast_shape("where", *[o.shape for o in operands if isinstance(o, TensorNode)])
    return compute(shape, lambda *i: select(operand_value(condition, i, shape, dtypes.boolean),
                                            operand_value(input, i, shape, t),
                                            operand_value(other, i, shape, t)))


@operator("clamp")
def clamp(input, min=None, max=None):
    """`input` limited to [min, max]; either bound may be None, a Python scalar or a tensor
    (broadcast). Where min > max the result is max; NaN stays NaN."""
    if min is None and max is None:
        raise OperatorError("clamp: at least one of 'min' and 'max' must be given")
    bounds = [(b, f) for b, f in ((min, ir.maximum), (max, ir.minimum)) if b is not None]

    def fn(v, *limits):
        for (_, f), limit in zip(bounds, limits):
            v = f(v, limit)
        return v

    return elementwise_compute("clamp", (input, *[b for b, _ in bounds]), fn, NUMERIC)


@operator("cast", traits=Traits(implements=Role.CAST))
def cast_op(input, dtype):
    """`input` converted to `dtype` (a torch dtype, a name or a Kiln DataType), as Tensor.to does:
    floats to integers truncate toward zero, anything nonzero to bool is true."""
    try:
        target = dtypes.data_type(dtype)
    except TypeError as exc:
        raise OperatorError(f"cast: {exc}") from None
    return compute(input.shape, lambda *i: cast(input[i], target))
