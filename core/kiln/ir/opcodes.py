"""The operations of scalar expressions: `Unary.op`, `Binary.op` and `Reduce.op`.

Each is an enum whose members are also their plain names (`BinaryOp.ADD == "add"`, equal hash,
printed as "add"), so code and plugins that spell an operation as a string keep working, and a
misspelt one is an error where the expression is built.
"""
from __future__ import annotations

from enum import Enum


class _OpName(str, Enum):
    __hash__ = str.__hash__
    __str__ = str.__str__
    __format__ = str.__format__
    __repr__ = str.__repr__


class UnaryOp(_OpName):
    """Operations of one operand."""

    NEG = "neg"
    ABS = "abs"
    EXP = "exp"
    EXPM1 = "expm1"
    LOG = "log"
    LOG1P = "log1p"
    LOG2 = "log2"
    SQRT = "sqrt"
    RSQRT = "rsqrt"
    SIN = "sin"
    COS = "cos"
    TAN = "tan"
    TANH = "tanh"
    ASIN = "asin"
    ACOS = "acos"
    ATAN = "atan"
    SINH = "sinh"
    COSH = "cosh"
    ASINH = "asinh"
    ACOSH = "acosh"
    ATANH = "atanh"
    ERF = "erf"
    FLOOR = "floor"
    CEIL = "ceil"
    ROUND = "round"
    TRUNC = "trunc"
    SIGN = "sign"
    NOT = "not"
    BITNOT = "bitnot"
    ISNAN = "isnan"
    ISINF = "isinf"
    # For float32 values that are rounded to a 16-bit float next: within 2^-16 relative (under
    # a quarter of bfloat16's and a 32nd of float16's rounding error), results below 2^-126
    # may flush to zero. C computes them exactly as EXP and 1 / x; CUDA uses the hardware's
    # approximations (`__expf`, `__fdividef`).
    EXP_APPROX = "exp_approx"
    RECIPROCAL_APPROX = "reciprocal_approx"


class BinaryOp(_OpName):
    """Operations of two operands."""

    ADD = "add"
    SUB = "sub"
    MUL = "mul"
    DIV = "div"
    FLOORDIV = "floordiv"
    MOD = "mod"
    FMOD = "fmod"
    POW = "pow"
    MAX = "max"
    MIN = "min"
    ATAN2 = "atan2"
    LT = "lt"
    LE = "le"
    GT = "gt"
    GE = "ge"
    EQ = "eq"
    NE = "ne"
    AND = "and"
    OR = "or"
    BITAND = "bitand"
    BITOR = "bitor"
    BITXOR = "bitxor"
    SHL = "shl"
    SHR = "shr"


class ReduceOp(_OpName):
    """Reductions; ARGMAX and ARGMIN give the position of the first extreme element."""

    SUM = "sum"
    PROD = "prod"
    MAX = "max"
    MIN = "min"
    ARGMAX = "argmax"
    ARGMIN = "argmin"


COMPARISONS = frozenset({BinaryOp.LT, BinaryOp.LE, BinaryOp.GT, BinaryOp.GE, BinaryOp.EQ, BinaryOp.NE})
LOGICAL = frozenset({BinaryOp.AND, BinaryOp.OR})
ARG_REDUCTIONS = frozenset({ReduceOp.ARGMAX, ReduceOp.ARGMIN})


def op_of(kind: type[_OpName], op) -> _OpName:
    """`op` (a member or its name) as a member of `kind`; a clear error for an unknown name."""
    try:
        return kind(op)
    except ValueError:
        raise ValueError(f"unknown {kind.__name__} '{op}'; expected one of "
                         f"{', '.join(m.value for m in kind)}") from None
