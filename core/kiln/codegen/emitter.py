"""Rendering scalar expressions to C-like statements.

`Emitter` turns an expression DAG into a sequence of `const T vN = ...;` statements with
common sub-expressions shared, and returns the name holding the value. A `Dialect` (C for the
CPU, CUDA C++ for GPUs) spells the types, the math functions and the loads and stores.
Reductions become accumulation loops; a `Select` whose sides read memory or check their
inputs becomes an if/else, so that a guarded load (padding, bounds) is never executed out of
bounds and a check runs only where its value is used. A `Check` becomes a test that calls the
dialect's `fail` with the check's code: its position (from 1) in `Emitter.checks`.

Symbolic sizes (`kiln.ir.size`: `SizeVar`s in expressions, `SymSize` extents) are written as
their values, unless the emitter is given a `kiln.codegen.sizes.SizeArgs`: then each is a
kernel parameter, so that the kernels of every size share one source.
"""
from __future__ import annotations

import math

from kiln import dtypes
from kiln.dtypes import DataType
from kiln.ir.expr import Binary, Cast, Check, Const, Expr, Load, Reduce, Select, SizeVar, Unary, Var, as_expr, walk
from kiln.ir.simplify import bounds, simplify

_FLOAT_FUNCS = {
    "exp": "exp", "exp_approx": "exp", "expm1": "expm1", "log": "log", "log1p": "log1p", "log2": "log2", "sqrt": "sqrt",
    "sin": "sin", "cos": "cos", "tan": "tan", "tanh": "tanh", "asin": "asin", "acos": "acos",
    "atan": "atan", "sinh": "sinh", "cosh": "cosh", "asinh": "asinh", "acosh": "acosh",
    "atanh": "atanh", "erf": "erf", "floor": "floor", "ceil": "ceil", "round": "nearbyint",
    "trunc": "trunc", "abs": "fabs",
}
_C_OPS = {"add": "+", "sub": "-", "mul": "*", "lt": "<", "le": "<=", "gt": ">", "ge": ">=",
          "eq": "==", "ne": "!=", "and": "&&", "or": "||", "bitand": "&", "bitor": "|",
          "bitxor": "^", "shl": "<<", "shr": ">>"}


class Dialect:
    """How one target language spells types, constants, math, loads and stores.

    The defaults are C99; CUDA overrides what differs.
    """

    def storage_type(self, t: DataType) -> str:
        return {"float16": "uint16_t", "bfloat16": "uint16_t"}.get(t.name, t.c_type)

    def value_type(self, t: DataType) -> str:
        """The type that holds a value during computation (16-bit floats compute in float)."""
        return "float" if t.is_16bit_float else t.c_type

    def load(self, t: DataType, ref: str) -> str:
        if t.name == "float16":
            return f"kiln_h2f({ref})"
        if t.name == "bfloat16":
            return f"kiln_bf2f({ref})"
        return ref

    def store(self, t: DataType, value: str) -> str:
        if t.name == "float16":
            return f"kiln_f2h({value})"
        if t.name == "bfloat16":
            return f"kiln_f2bf({value})"
        return value

    def round_to(self, t: DataType, value: str) -> str:
        """Round a float value to a 16-bit float type and back."""
        return self.load(t, self.store(t, value))

    def math_suffix(self, t: DataType) -> str:
        return "" if t.name == "float64" else "f"

    def const(self, value, t: DataType) -> str:
        if t.is_bool:
            return "true" if value else "false"
        if t.is_integer:
            if t.name == "int64" and value == -(2 ** 63):
                return "INT64_MIN"
            return f"((int64_t){value}LL)" if t.name == "int64" else f"(({t.c_type}){value})"
        if math.isnan(value):
            return "NAN" if t.name != "float64" else "((double)NAN)"
        if math.isinf(value):
            sign = "-" if value < 0 else ""
            return f"{sign}INFINITY" if t.name != "float64" else f"({sign}(double)INFINITY)"
        text = repr(float(value))
        return text if t.name == "float64" else f"{text}f"

    def unary(self, op: str, t: DataType, a: str, at: DataType) -> str:
        if op == "neg":
            return self.narrow(t, f"-{a}")
        if op == "not":
            return f"(!{a})"
        if op == "bitnot":
            return self.narrow(t, f"~{a}")
        if op == "isnan":
            return f"({a} != {a})" if at.is_float else "false"
        if op == "isinf":
            return f"(isinf({a}) != 0)" if at.is_float else "false"
        if op == "sign":
            if t.is_bool:
                return a
            vt = self.value_type(t)  # NaN and -0.0 give 0, as in PyTorch
            return f"(({a} > 0) ? ({vt})1 : (({a} < 0) ? ({vt})-1 : ({vt})0))"
        if not t.is_float:
            if op == "abs":
                return self.narrow(t, f"({a} < 0 ? -{a} : {a})")
            if op in ("floor", "ceil", "round", "trunc"):
                return a
            raise TypeError(f"'{op}' is defined for floating-point values, not {t}")
        s = self.math_suffix(t)
        if op == "rsqrt":
            return f"({self.const(1.0, t)} / sqrt{s}({a}))"
        if op == "reciprocal_approx":
            return f"({self.const(1.0, t)} / {a})"
        return f"{_FLOAT_FUNCS[op]}{s}({a})"

    def narrow(self, t: DataType, text: str) -> str:
        """Wrap integer arithmetic so it wraps at the type's width."""
        if t.is_integer and t.nbytes < 8:
            return f"(({t.c_type})({text}))"
        return f"({text})"

    def binary(self, op: str, t: DataType, a: str, b: str, at: DataType) -> str:
        if op in ("lt", "le", "gt", "ge", "eq", "ne", "and", "or"):
            return f"({a} {_C_OPS[op]} {b})"
        if op in _C_OPS:
            return self.narrow(t, f"{a} {_C_OPS[op]} {b}")
        if t.is_float:
            s = self.math_suffix(t)
            kind = "d" if t.name == "float64" else "f"
            if op == "div":
                return f"({a} / {b})"
            if op == "pow":
                return f"pow{s}({a}, {b})"
            if op == "atan2":
                return f"atan2{s}({a}, {b})"
            if op == "fmod":
                return f"fmod{s}({a}, {b})"
            return f"kiln_{op}_{kind}({a}, {b})"
        if op in ("max", "min"):
            cmp = ">" if op == "max" else "<"
            return f"(({a} {cmp} {b}) ? {a} : {b})"
        return self.narrow(t, f"kiln_{op}_i64({a}, {b})")

    def fail(self, code: int, check: Check, reported: str) -> str:
        """The statement reporting that `check` (numbered `code`) failed, showing `reported`:
        in C, the first failure's code and value go to the kernel's status buffer."""
        return f"kiln_fail({KernelArgs.STATUS}, {code}, (int64_t)({reported}));"

    def cast(self, a: str, src: DataType, dst: DataType) -> str:
        if dst.is_bool:
            return f"({a} != 0)"
        if dst.is_16bit_float:
            return self.round_to(dst, f"(float)({a})")
        if dst.kind == "uint" and src.is_float:
            return f"(({dst.c_type})(int64_t)({a}))"
        return f"(({self.value_type(dst)})({a}))"


def reduce_init(op: str, t: DataType, dialect: Dialect) -> str:
    """The identity of a reduction in type `t`."""
    if op == "sum":
        return dialect.const(0, t)
    if op == "prod":
        return dialect.const(1, t)
    high = op in ("min", "argmin")
    if t.is_float:
        return dialect.const(math.inf if high else -math.inf, t)
    if t.is_bool:
        return dialect.const(high, t)
    bits = t.nbytes * 8
    if t.kind == "uint":
        return dialect.const((1 << bits) - 1 if high else 0, t)
    return dialect.const((1 << (bits - 1)) - 1 if high else -(1 << (bits - 1)), t)


def reduce_combine(op: str, t: DataType, acc: str, v: str, dialect: Dialect) -> str:
    """The statement folding value `v` into accumulator `acc`."""
    if op == "sum":
        return f"{acc} = {dialect.narrow(t, f'{acc} + {v}') if t.is_integer else f'{acc} + {v}'};"
    if op == "prod":
        return f"{acc} = {dialect.narrow(t, f'{acc} * {v}') if t.is_integer else f'{acc} * {v}'};"
    return f"{acc} = {dialect.binary(op, t, acc, v, t)};"


class Emitter:
    """Emits statements computing expressions; shares sub-expressions within a scope.

    `names` maps index variables (by id) and buffers (by id of their tensor node) to the C
    names the caller declared; `strides` gives each buffer's row-major strides; `sizes` (a
    `kiln.codegen.sizes.SizeArgs`), when given, makes symbolic sizes kernel parameters.
    """

    def __init__(self, dialect: Dialect, names: dict[int, str], strides: dict[int, tuple[int, ...]],
                 indent: int = 1, sizes=None):
        self.dialect = dialect
        self.sizes = sizes
        self.names = dict(names)
        self.strides = strides
        self.lines: list[str] = []
        self.indent = indent
        self.scopes: list[dict] = [{}]
        self.counter = 0
        self._simplify_memo: dict = {}
        self.checks: list[Check] = []       # the checks emitted, by code - 1

    def line(self, text: str) -> None:
        self.lines.append("    " * self.indent + text)

    def fresh(self, prefix: str = "v") -> str:
        self.counter += 1
        return f"{prefix}{self.counter}"

    def open(self, header: str) -> None:
        self.line(header + " {")
        self.indent += 1
        self.scopes.append({})

    def close(self) -> None:
        self.scopes.pop()
        self.indent -= 1
        self.line("}")

    def _lookup(self, key):
        for scope in reversed(self.scopes):
            if key in scope:
                return scope[key]
        return None

    def let(self, t: DataType, text: str, key=None) -> str:
        name = self.fresh()
        self.line(f"const {self.dialect.value_type(t)} {name} = {text};")
        if key is not None:
            self.scopes[-1][key] = name
        return name

    def size(self, size) -> str:
        """C text of a size (an int or a SymSize; see the module doc)."""
        return self.sizes.text(size) if self.sizes is not None else str(int(size))

    def offset(self, load: Load) -> str:
        """The flat element offset of a load."""
        strides = self.strides[id(load.tensor)]
        flat = None
        for idx, stride in zip(load.indices, strides):
            term = idx * stride if stride != 1 else idx
            flat = term if flat is None else flat + term
        return self.emit(simplify(flat, self._simplify_memo)) if flat is not None else "0"

    def emit(self, e: Expr) -> str:
        """Emit statements for `e` and return the C expression (a name or literal) of its value."""
        if isinstance(e, Const):
            return self.dialect.const(e.value, e.dtype)
        if isinstance(e, Var):
            if id(e) not in self.names:
                raise KeyError(f"index variable '{e.name}' is not bound in this kernel")
            return self.names[id(e)]
        if isinstance(e, SizeVar):
            return self.sizes.param(e) if self.sizes is not None else self.dialect.const(e.value, e.dtype)
        key = e.key()
        found = self._lookup(key)
        if found is not None:
            return found
        d = self.dialect
        if isinstance(e, Load):
            ref = f"{self.names[id(e.tensor)]}[{self.offset(e)}]"
            return self.let(e.dtype, d.load(e.dtype, ref), key)
        if isinstance(e, Unary):
            return self.let(e.dtype, d.unary(e.op, e.dtype, self.emit(e.a), e.a.dtype), key)
        if isinstance(e, Binary):
            if e.dtype.is_integer and e.op in ("floordiv", "mod") and _nonneg(e.a) and _positive(e.b):
                text = d.narrow(e.dtype, f"{self.emit(e.a)} {'/' if e.op == 'floordiv' else '%'} {self.emit(e.b)}")
            else:
                text = d.binary(e.op, e.dtype, self.emit(e.a), self.emit(e.b), e.a.dtype)
            return self.let(e.dtype, text, key)
        if isinstance(e, Cast):
            return self.let(e.dtype, d.cast(self.emit(e.a), e.a.dtype, e.dtype), key)
        if isinstance(e, Select):
            return self._select(e, key)
        if isinstance(e, Reduce):
            return self._reduce(e, key)
        if isinstance(e, Check):
            return self._check(e, key)
        raise TypeError(f"cannot emit {type(e).__name__}")

    def check_code(self, e: Check) -> int:
        """The code of check `e`: one per distinct error and message, from 1."""
        for k, known in enumerate(self.checks):
            if (known.error, known.message) == (e.error, e.message):
                return k + 1
        self.checks.append(e)
        return len(self.checks)

    def _check(self, e: Check, key) -> str:
        ok = self.emit(e.ok)
        self.open(f"if (!({ok}))")
        self.line(self.dialect.fail(self.check_code(e), e, self.emit(e.reported)))
        self.close()
        value = self.emit(e.value)
        self.scopes[-1][key] = value
        return value

    def _select(self, e: Select, key) -> str:
        cond = self.emit(e.cond)
        if not (_reads_memory(e.a) or _reads_memory(e.b)):
            return self.let(e.dtype, f"({cond} ? {self.emit(e.a)} : {self.emit(e.b)})", key)
        name = self.fresh()
        self.line(f"{self.dialect.value_type(e.dtype)} {name};")
        self.open(f"if ({cond})")
        self.line(f"{name} = {self.emit(e.a)};")
        self.close()
        self.open("else")
        self.line(f"{name} = {self.emit(e.b)};")
        self.close()
        self.scopes[-1][key] = name
        return name

    def _reduce(self, e: Reduce, key) -> str:
        d = self.dialect
        t = e.body.dtype
        acc = self.fresh("acc")
        arg = e.op in ("argmax", "argmin")
        self.line(f"{d.value_type(t)} {acc} = {reduce_init(e.op, t, d)};")
        if arg:
            pos, flat = self.fresh("pos"), self.fresh("r")
            self.line(f"int64_t {pos} = 0, {flat} = 0;")
        for axis in e.axes:
            name = self.fresh("r")
            self.names[id(axis)] = name
            self.open(f"for (int64_t {name} = 0; {name} < {self.emit(_as_int(axis.extent))}; ++{name})")
        v = self.emit(e.body)
        if arg:
            better = ">" if e.op == "argmax" else "<"
            nan = f" || ({v} != {v} && {acc} == {acc})" if t.is_float else ""
            self.open(f"if ({v} {better} {acc}{nan})")
            self.line(f"{acc} = {v}; {pos} = {flat};")
            self.close()
            self.line(f"++{flat};")
        else:
            self.line(reduce_combine(e.op, t, acc, v, d))
        for _ in e.axes:
            self.close()
        result = pos if arg else acc
        self.scopes[-1][key] = result
        return result


def _as_int(extent):
    return as_expr(extent, dtypes.int64)


def _nonneg(e: Expr) -> bool:
    b = bounds(e)
    return b is not None and b[0] >= 0


def _positive(e: Expr) -> bool:
    b = bounds(e)
    return b is not None and b[0] > 0


def _reads_memory(e: Expr) -> bool:
    return any(isinstance(x, (Load, Reduce, Check)) for x in walk(e))


def numel(shape) -> int:
    """The number of elements of `shape`."""
    n = 1
    for s in shape:
        n *= s
    return n


def row_major_strides(shape) -> tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= s
    return tuple(reversed(strides))


class KernelArgs:
    """The one owner of kernel argument names.

    A kernel's buffers are the task's inputs `in0, in1, ...`, its outputs `out0, ...` and the
    temporaries its program allocates for each run, `tmp0, ...`; schedules and templates name
    them through here, and the runtimes bind pointers to them through `bind`. Symbolic sizes
    are int64 parameters `kiln_size0, ...` (see `kiln.codegen.sizes`).
    """

    STATUS = "kiln_status"      # a CPU kernel's status buffer (see kiln.runtime.kernel_errors)

    @staticmethod
    def input(k: int) -> str:
        return f"in{k}"

    @staticmethod
    def output(k: int) -> str:
        return f"out{k}"

    @staticmethod
    def temporary(k: int) -> str:
        return f"tmp{k}"

    @staticmethod
    def size(k: int) -> str:
        """The k-th symbolic size parameter (see `kiln.codegen.sizes`)."""
        return f"kiln_size{k}"

    @classmethod
    def names(cls, inputs=(), outputs=(), temporaries=()) -> dict[int, str]:
        """Argument names by tensor id (inputs, outputs and temporaries, each numbered from 0)."""
        found = {id(t): cls.input(k) for k, t in enumerate(inputs)}
        found.update({id(t): cls.output(k) for k, t in enumerate(outputs)})
        found.update({id(t): cls.temporary(k) for k, t in enumerate(temporaries)})
        return found

    @classmethod
    def params(cls, dialect: Dialect, inputs, outputs) -> list[str]:
        """The parameter declarations of a kernel over `inputs` (read-only) and `outputs`."""
        return ([f"const {dialect.storage_type(t.dtype)}* __restrict__ {cls.input(k)}" for k, t in enumerate(inputs)]
                + [f"{dialect.storage_type(t.dtype)}* __restrict__ {cls.output(k)}" for k, t in enumerate(outputs)])

    @classmethod
    def args(cls, num_inputs: int, num_outputs: int = 1) -> list[str]:
        """The names of `num_inputs` inputs then `num_outputs` outputs, in parameter order."""
        return [cls.input(k) for k in range(num_inputs)] + [cls.output(k) for k in range(num_outputs)]

    @classmethod
    def positions(cls, args, num_inputs: int, num_outputs: int) -> tuple[int, ...]:
        """Where each argument named in `args` is in `[*inputs, *outputs]` (-1 for `STATUS`):
        what a runtime binds a call's pointers by without naming them."""
        where = {cls.STATUS: -1}
        where.update({cls.input(k): k for k in range(num_inputs)})
        where.update({cls.output(k): num_inputs + k for k in range(num_outputs)})
        return tuple(where[name] for name in args)

    @classmethod
    def bind(cls, inputs, outputs, temporaries=()) -> dict[str, int]:
        """Device pointers by argument name of the given torch tensors."""
        found = {cls.input(k): t.data_ptr() for k, t in enumerate(inputs)}
        found.update({cls.output(k): t.data_ptr() for k, t in enumerate(outputs)})
        found.update({cls.temporary(k): t.data_ptr() for k, t in enumerate(temporaries)})
        return found
