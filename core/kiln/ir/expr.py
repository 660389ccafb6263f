"""Scalar expressions of the compute IR.

An expression computes one element: it reads tensor elements (`Load`), combines them with
arithmetic (`Unary`, `Binary`), converts types (`Cast`), chooses (`Select`), reduces over
reduction axes (`Reduce`) and checks its inputs (`Check`: a kernel reports an error where a
condition fails, e.g. an index out of range or an integer division by zero). Python operators build expressions; Python scalars in them take the
type of the expression beside them, as in PyTorch.
"""
from __future__ import annotations

import itertools
from typing import Callable, Sequence

import torch

from kiln import dtypes
from kiln.dtypes import DataType
from kiln.ir import size_reads
from kiln.ir.opcodes import ARG_REDUCTIONS, COMPARISONS, LOGICAL, BinaryOp, ReduceOp, UnaryOp, op_of

_ids = itertools.count()


class Expr:
    """A scalar expression with a data type."""

    __slots__ = ("dtype", "_key")

    def __init__(self, dtype: DataType):
        self.dtype = dtype
        self._key = None

    def children(self) -> tuple["Expr", ...]:
        return ()

    def key(self) -> tuple:
        """A structural key: equal keys mean the same computation."""
        if self._key is None:
            self._key = self._make_key()
        return self._key

    def _make_key(self) -> tuple:
        raise NotImplementedError

    # arithmetic
    def __add__(self, o): return binary(BinaryOp.ADD, self, o)
    def __radd__(self, o): return binary(BinaryOp.ADD, o, self)
    def __sub__(self, o): return binary(BinaryOp.SUB, self, o)
    def __rsub__(self, o): return binary(BinaryOp.SUB, o, self)
    def __mul__(self, o): return binary(BinaryOp.MUL, self, o)
    def __rmul__(self, o): return binary(BinaryOp.MUL, o, self)
    def __truediv__(self, o): return binary(BinaryOp.DIV, self, o)
    def __rtruediv__(self, o): return binary(BinaryOp.DIV, o, self)
    def __floordiv__(self, o): return binary(BinaryOp.FLOORDIV, self, o)
    def __rfloordiv__(self, o): return binary(BinaryOp.FLOORDIV, o, self)
    def __mod__(self, o): return binary(BinaryOp.MOD, self, o)
    def __rmod__(self, o): return binary(BinaryOp.MOD, o, self)
    def __pow__(self, o): return binary(BinaryOp.POW, self, o)
    def __rpow__(self, o): return binary(BinaryOp.POW, o, self)
    def __neg__(self): return unary(UnaryOp.NEG, self)
    def __lt__(self, o): return binary(BinaryOp.LT, self, o)
    def __le__(self, o): return binary(BinaryOp.LE, self, o)
    def __gt__(self, o): return binary(BinaryOp.GT, self, o)
    def __ge__(self, o): return binary(BinaryOp.GE, self, o)
    def __and__(self, o): return binary(BinaryOp.AND if self.dtype.is_bool else BinaryOp.BITAND, self, o)
    def __or__(self, o): return binary(BinaryOp.OR if self.dtype.is_bool else BinaryOp.BITOR, self, o)
    def __xor__(self, o): return binary(BinaryOp.NE if self.dtype.is_bool else BinaryOp.BITXOR, self, o)
    def __invert__(self): return unary(UnaryOp.NOT if self.dtype.is_bool else UnaryOp.BITNOT, self)

    def __bool__(self):
        raise TypeError("a Kiln expression has no truth value; use select(cond, a, b)")

    __hash__ = object.__hash__

    def __repr__(self) -> str:
        return f"{type(self).__name__}{self.key()}"


class Var(Expr):
    """An index variable ranging over [0, extent)."""

    __slots__ = ("name", "extent", "uid")

    def __init__(self, name: str, extent):
        super().__init__(dtypes.int64)
        self.name = name
        self.extent = extent
        self.uid = next(_ids)

    def _make_key(self):
        return ("var", self.uid)


class SizeVar(Expr):
    """A size that is a kernel argument: the int64 `name`, whose value is `value` in the trace
    that made it (see `kiln.ir.size`; reading it is a read of the size's value, see
    `kiln.ir.size_reads`; `traced` is that value, for what tells sizes apart without deciding
    on it: keys, kernel arguments)."""

    __slots__ = ("name", "traced")

    def __init__(self, name: str, value: int):
        super().__init__(dtypes.int64)
        self.name = name
        self.traced = int.__int__(value)

    @property
    def value(self) -> int:
        size_reads.note_read(f"the value of size {self.name}")
        return self.traced

    def _make_key(self):
        return ("size", self.name, self.traced)


class Const(Expr):
    """A constant of a given type."""

    __slots__ = ("value",)

    def __init__(self, value, dtype: DataType):
        super().__init__(dtype)
        if dtype.is_bool:
            value = bool(value)
        elif dtype.is_integer:
            value = int(value)
        else:
            value = float(value)
            if dtype.is_16bit_float:  # a value of the type itself, as PyTorch converts scalars
                value = torch.tensor(value).to(dtype.torch_dtype).item()
        self.value = value

    def _make_key(self):
        return ("const", self.dtype.name, repr(self.value))


class Load(Expr):
    """The element of a tensor node at the given indices."""

    __slots__ = ("tensor", "indices")

    def __init__(self, tensor, indices: Sequence[Expr]):
        super().__init__(tensor.dtype)
        if len(indices) != len(tensor.shape):
            raise IndexError(
                f"tensor '{tensor.name}' of rank {len(tensor.shape)} indexed with {len(indices)} indices"
            )
        self.tensor = tensor
        self.indices = tuple(as_expr(i, dtypes.int64) for i in indices)

    def children(self):
        return self.indices

    def _make_key(self):
        return ("load", id(self.tensor)) + tuple(i.key() for i in self.indices)


class Unary(Expr):
    __slots__ = ("op", "a")

    def __init__(self, op: UnaryOp | str, a: Expr, dtype: DataType):
        super().__init__(dtype)
        self.op, self.a = op_of(UnaryOp, op), a

    def children(self):
        return (self.a,)

    def _make_key(self):
        return ("unary", self.op, self.a.key())


class Binary(Expr):
    __slots__ = ("op", "a", "b")

    def __init__(self, op: BinaryOp | str, a: Expr, b: Expr, dtype: DataType):
        super().__init__(dtype)
        self.op, self.a, self.b = op_of(BinaryOp, op), a, b

    def children(self):
        return (self.a, self.b)

    def _make_key(self):
        return ("binary", self.op, self.a.key(), self.b.key())


class Cast(Expr):
    __slots__ = ("a",)

    def __init__(self, a: Expr, dtype: DataType):
        super().__init__(dtype)
        self.a = a

    def children(self):
        return (self.a,)

    def _make_key(self):
        return ("cast", self.dtype.name, self.a.key())


class Select(Expr):
    """`a` where `cond` holds, else `b`; only the chosen side is evaluated."""

    __slots__ = ("cond", "a", "b")

    def __init__(self, cond: Expr, a: Expr, b: Expr):
        super().__init__(a.dtype)
        self.cond, self.a, self.b = cond, a, b

    def children(self):
        return (self.cond, self.a, self.b)

    def _make_key(self):
        return ("select", self.cond.key(), self.a.key(), self.b.key())


class Reduce(Expr):
    """A reduction of `body` over the reduction axes `axes`.

    `op` is a `ReduceOp`. argmax and argmin give the position of the first extreme element,
    as an int64 counted row-major over the reduction axes.
    """

    __slots__ = ("op", "axes", "body")

    def __init__(self, op: ReduceOp | str, axes: Sequence[Var], body: Expr, dtype: DataType):
        super().__init__(dtype)
        self.op, self.axes, self.body = op_of(ReduceOp, op), tuple(axes), body

    def children(self):
        return (self.body,) + tuple(as_expr(a.extent, dtypes.int64) for a in self.axes)

    def _make_key(self):
        return ("reduce", self.op, self.dtype.name, tuple(a.key() for a in self.axes), self.body.key())


class Check(Expr):
    """`value`, where `ok` holds; where it does not, the kernel fails: on the CPU the call
    raises `error` (a name of `kiln.runtime.kernel_errors.KERNEL_ERRORS`: 'IndexError',
    'ZeroDivisionError', 'RuntimeError') with `message`, in which `{value}` stands for the int64
    `reported`; on a GPU the kernel traps. `value` must be safe to compute either way (a
    clamped index, a guarded division)."""

    __slots__ = ("value", "ok", "error", "message", "reported")

    def __init__(self, value: Expr, ok: Expr, error: str, message: str, reported: Expr):
        super().__init__(value.dtype)
        self.value, self.ok, self.reported = value, ok, reported
        self.error, self.message = error, message

    def children(self):
        return (self.value, self.ok, self.reported)

    def _make_key(self):
        return ("check", self.error, self.message, self.value.key(), self.ok.key(), self.reported.key())


# ---------------------------------------------------------------- constructors

def as_expr(value, dtype: DataType | None = None) -> Expr:
    """Wrap a Python scalar as a Const (of `dtype`, or its default type), a symbolic size
    (`kiln.ir.size.SymSize`) as its expression (converted to `dtype`); keep an Expr."""
    if isinstance(value, Expr):
        return value
    if type(value) is not int and isinstance(value, int) and hasattr(value, "size_expr"):
        return cast(value.size_expr(), dtype or dtypes.int64)
    if isinstance(value, (bool, int, float)):
        return Const(value, dtype or dtypes.scalar_type(value))
    raise TypeError(f"cannot use {type(value).__name__} {value!r} in a Kiln expression")


def _operands(a, b) -> tuple[Expr, Expr]:
    if isinstance(a, Expr) and isinstance(b, Expr):
        if a.dtype != b.dtype:
            t = dtypes.promote(a.dtype, b.dtype)
            a, b = cast(a, t), cast(b, t)
        return a, b
    if isinstance(a, Expr):
        t = dtypes.promote_with_scalar(a.dtype, b)
        return cast(a, t), as_expr(b, t)
    if isinstance(b, Expr):
        t = dtypes.promote_with_scalar(b.dtype, a)
        return as_expr(a, t), cast(b, t)
    return as_expr(a), as_expr(b)


def binary(op: BinaryOp | str, a, b) -> Expr:
    """A binary expression, promoting the operand types as PyTorch does."""
    op = op_of(BinaryOp, op)
    a, b = _operands(a, b)
    if op in LOGICAL:
        a, b = cast(a, dtypes.boolean), cast(b, dtypes.boolean)
    dtype = dtypes.boolean if op in COMPARISONS or op in LOGICAL else a.dtype
    return Binary(op, a, b, dtype)


def unary(op: UnaryOp | str, a) -> Expr:
    """A unary expression (`not` converts its operand to bool)."""
    op = op_of(UnaryOp, op)
    a = as_expr(a)
    if op == UnaryOp.NOT:
        a = cast(a, dtypes.boolean)
    dtype = dtypes.boolean if op in (UnaryOp.NOT, UnaryOp.ISNAN, UnaryOp.ISINF) else a.dtype
    return Unary(op, a, dtype)


def cast(a, dtype) -> Expr:
    """Convert `a` to `dtype` (a no-op if it already has it)."""
    dtype = dtypes.data_type(dtype)
    a = as_expr(a, dtype)
    return a if a.dtype == dtype else Cast(a, dtype)


def select(cond, a, b) -> Expr:
    """`a` where `cond` is true, else `b` (the operand types are promoted together)."""
    a, b = _operands(a, b)
    return Select(cast(cond, dtypes.boolean), a, b)


def check(ok, value, error: str, message: str, reported=0) -> Expr:
    """`value`, checked: a kernel computing it fails with `error` and `message` (see `Check`)
    where `ok` is false; `{value}` in `message` shows `reported` (an integer expression)."""
    value = as_expr(value)
    return Check(value, cast(ok, dtypes.boolean), error, message, cast(reported, dtypes.int64))


def reduce(extents: Sequence, fbody: Callable[..., Expr], op: ReduceOp | str = ReduceOp.SUM,
           dtype=None) -> Expr:
    """Reduce `fbody(*r)` over axes r with the given extents.

    `dtype` is the accumulator and result type (by default the body's type; int64 for
    argmax/argmin). An extent may itself be an expression of outer index variables.
    """
    op = op_of(ReduceOp, op)
    axes = [Var(f"r{k}", e) for k, e in enumerate(extents)]
    body = as_expr(fbody(*axes))
    if op in ARG_REDUCTIONS:
        return Reduce(op, axes, body, dtypes.int64)
    acc = dtypes.data_type(dtype) if dtype is not None else body.dtype
    return Reduce(op, axes, cast(body, acc), acc)


def _unary_fn(op):
    def fn(x):
        return unary(op, x)
    fn.__name__ = op.value
    fn.__doc__ = f"Elementwise `{op}` of a scalar expression."
    return fn


def _binary_fn(op):
    def fn(a, b):
        return binary(op, a, b)
    fn.__name__ = op.value
    fn.__doc__ = f"Elementwise `{op}` of two scalar expressions."
    return fn


exp, expm1, log, log1p, log2 = map(_unary_fn, (UnaryOp.EXP, UnaryOp.EXPM1, UnaryOp.LOG, UnaryOp.LOG1P,
                                                UnaryOp.LOG2))
sqrt, rsqrt, sin, cos, tan, tanh = map(_unary_fn, (UnaryOp.SQRT, UnaryOp.RSQRT, UnaryOp.SIN, UnaryOp.COS,
                                                   UnaryOp.TAN, UnaryOp.TANH))
asin, acos, atan, sinh, cosh = map(_unary_fn, (UnaryOp.ASIN, UnaryOp.ACOS, UnaryOp.ATAN, UnaryOp.SINH,
                                               UnaryOp.COSH))
asinh, acosh, atanh, erf = map(_unary_fn, (UnaryOp.ASINH, UnaryOp.ACOSH, UnaryOp.ATANH, UnaryOp.ERF))
floor, ceil, round_even, trunc, sign = map(_unary_fn, (UnaryOp.FLOOR, UnaryOp.CEIL, UnaryOp.ROUND,
                                                       UnaryOp.TRUNC, UnaryOp.SIGN))
abs_, isnan, isinf, logical_not = map(_unary_fn, (UnaryOp.ABS, UnaryOp.ISNAN, UnaryOp.ISINF, UnaryOp.NOT))
exp_approx, reciprocal_approx = map(_unary_fn, (UnaryOp.EXP_APPROX, UnaryOp.RECIPROCAL_APPROX))
maximum, minimum, fmod, atan2 = map(_binary_fn, (BinaryOp.MAX, BinaryOp.MIN, BinaryOp.FMOD, BinaryOp.ATAN2))
eq, ne, logical_and, logical_or = map(_binary_fn, (BinaryOp.EQ, BinaryOp.NE, BinaryOp.AND, BinaryOp.OR))
bitwise_and, bitwise_or, bitwise_xor = map(_binary_fn, (BinaryOp.BITAND, BinaryOp.BITOR, BinaryOp.BITXOR))
shift_left, shift_right = map(_binary_fn, (BinaryOp.SHL, BinaryOp.SHR))


def walk(expr: Expr):
    """Every distinct sub-expression of `expr` (including Loads' tensors' own bodies: no)."""
    seen, stack = set(), [expr]
    while stack:
        e = stack.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        stack.extend(e.children())


def top_reduces(e: Expr) -> list[Reduce]:
    """The reductions of `e` that are not inside another reduction (what a schedule spreads over
    threads or lanes)."""
    found, seen, stack = [], set(), [e]
    while stack:
        x = stack.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, Reduce):
            found.append(x)
            continue
        stack.extend(x.children())
    return found
