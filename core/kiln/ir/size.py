"""Symbolic sizes: dimensions that change from run to run (dynamo's SymInts).

A `SymSize` is an int: its value in the trace being compiled, with which every decision is
taken (shapes, bounds, schedules), exactly as for a plain int. It also carries how that value
is computed from run-time sizes, as a polynomial over atoms (a `SizeVar` such as s0, or a
floor division or remainder of polynomials), normalized so that equal expressions
compare equal (`(s0 * 16) // 16` is s0). Python arithmetic on SymSizes (+, -, *, //, %) keeps
both; anything else (a comparison, `int()`, `/`) sees the value. A result whose expression is a
constant is a plain int. What sees the value is recorded where a computation asks
(`kiln.ir.size_reads`): a comparison with an int or SymSize as a guard, which `guards_hold`
asks again with the size variables at other values (`value_at` evaluates a size there), and
anything else as a read of the value.

Code generation that opts in (`kiln.codegen.emitter.SizeArgs`) writes the expression instead of
the value and takes the sizes as kernel arguments, so that the kernels of two sizes have the
same source and build once. Whatever is derived from a SymSize is correct for its own trace:
where generation only used the value, the source holds the value (and differs per size).

Each atom knows its value, so an expression's value is its own: `size_key` tells shapes apart
by expression and value, for caches that must not hand a task of one size to another.
"""
from __future__ import annotations

import math
import operator
from typing import Iterable

from kiln import dtypes
from kiln.ir import size_reads
from kiln.ir.expr import Binary, Const, Expr, SizeVar, Var
from kiln.ir.opcodes import BinaryOp

# A polynomial: ((monomial, coefficient), ...) sorted, without zero coefficients; a monomial
# is a sorted tuple of atoms (with repeats for powers); an atom is ("size", name, value) or
# (op, polynomial, polynomial) with op "floordiv" or "mod" (a quotient or remainder that does
# not simplify).
_ATOM_OPS = {"floordiv": (BinaryOp.FLOORDIV, lambda a, b: a // b), "mod": (BinaryOp.MOD, lambda a, b: a % b)}


def _constant(c: int) -> tuple:
    return (((), c),) if c else ()


def _normal(terms: Iterable[tuple[tuple, int]]) -> tuple:
    merged: dict[tuple, int] = {}
    for monomial, coef in terms:
        merged[monomial] = merged.get(monomial, 0) + coef
    return tuple(sorted((m, c) for m, c in merged.items() if c))


def _add(p: tuple, q: tuple) -> tuple:
    return _normal(p + q)


def _scale(p: tuple, k: int) -> tuple:
    return _normal((m, c * k) for m, c in p)


def _mul(p: tuple, q: tuple) -> tuple:
    return _normal((tuple(sorted(mp + mq)), cp * cq) for mp, cp in p for mq, cq in q)


def _constant_of(p: tuple) -> int | None:
    if not p:
        return 0
    return p[0][1] if len(p) == 1 and not p[0][0] else None


def _divide_term(term: tuple, q: tuple) -> tuple | None:
    """The monomial term / q where q is one term dividing it (coefficient and atoms), else None."""
    (mq, cq), = q
    rest = list(term[0])
    for atom in mq:
        if atom not in rest:
            return None
        rest.remove(atom)
    return (tuple(rest), term[1] // cq) if term[1] % cq == 0 else None


def _split(p: tuple, q: tuple) -> tuple[tuple, tuple]:
    """(quotient, rest) with p = q * quotient + rest, where the quotient takes every term of p
    that the single term q divides; q of several terms divides only a whole multiple of itself."""
    if len(q) > 1:
        first, coef = q[0]
        k = next((c // coef for m, c in p if m == first and c % coef == 0), None)
        return (_constant(k), ()) if k is not None and _scale(q, k) == p else ((), p)
    if not q:
        return (), p
    quotient, rest = [], []
    for term in p:
        divided = _divide_term(term, q)
        if divided is None:
            rest.append(term)
        else:
            quotient.append(divided)
    return _normal(quotient), tuple(rest)


def _atom_value(atom: tuple, values: dict[str, int] | None) -> int:
    if atom[0] == "size":
        return atom[2] if values is None else values[atom[1]]
    return _ATOM_OPS[atom[0]][1](_value(atom[1], values), _value(atom[2], values))


def _value(p: tuple, values: dict[str, int] | None = None) -> int:
    """The value of polynomial `p`: in its own trace, or with the size variables at `values`
    (name -> int)."""
    return sum(c * math.prod(_atom_value(a, values) for a in m) for m, c in p)


def _floordiv(p: tuple, q: tuple) -> tuple:
    quotient, rest = _split(p, q)
    if not rest:
        return quotient
    c, r = _constant_of(q), _constant_of(rest)
    if c and r is not None:
        return _add(quotient, _constant(r // c))
    return _add(quotient, (((("floordiv", rest, q),), 1),))


def _mod(p: tuple, q: tuple) -> tuple:
    _, rest = _split(p, q)
    if not rest:
        return ()
    c = _constant_of(q)
    if c is not None and c > 0:    # reduced coefficients leave the same remainder
        rest = _normal((m, k % c) for m, k in rest)
        if _constant_of(rest) is not None:
            return _constant(_constant_of(rest) % c)
    return (((("mod", rest, q),), 1),)


_int = int.__int__      # a value as int computes with it: no read of a SymSize's value (`size_reads`)


def _polynomial(x) -> tuple | None:
    if isinstance(x, SymSize):
        return x.polynomial
    if isinstance(x, int):
        return _constant(_int(x))
    return None


def _make(value: int, polynomial: tuple):
    """A SymSize of `value` computed by `polynomial`, or the plain int where it is constant."""
    if _value(polynomial) != value:
        raise AssertionError(f"symbolic size {polynomial} evaluates to {_value(polynomial)}, not {value}")
    return value if _constant_of(polynomial) is not None else SymSize(value, polynomial)


def _sub(p: tuple, q: tuple) -> tuple:
    return _add(p, _scale(q, -1))


def _binary(name: str, combine):
    """The forward and reflected methods of the int operator `name` on SymSizes: the value as
    int computes it, the polynomial by `combine`; with a non-int operand, int's own result."""
    forward_int, backward_int = getattr(int, f"__{name}__"), getattr(int, f"__r{name}__")

    def forward(self, other):
        q = _polynomial(other)
        if q is None:
            size_reads.note_read(f"{name} with {type(other).__name__}")
            return forward_int(_int(self), other)
        return _make(forward_int(_int(self), _int(other)), combine(self.polynomial, q))

    def backward(self, other):
        p = _polynomial(other)
        if p is None:
            size_reads.note_read(f"{name} with {type(other).__name__}")
            return backward_int(_int(self), other)
        return _make(forward_int(_int(other), _int(self)), combine(p, self.polynomial))

    return forward, backward


def _comparison(name: str):
    """int's comparison `name` on a SymSize, kept as a guard (`size_reads`) where the other
    side is an int; against anything else, a read of the value."""
    compare = getattr(int, f"__{name}__")

    def method(self, other):
        answer = compare(self, other)
        q = _polynomial(other)
        if q is None:
            if not isinstance(other, _NOT_NUMBERS):
                size_reads.note_read(f"{name} with {type(other).__name__}")
        elif answer is not NotImplemented:
            size_reads.note_guard(name, self.polynomial, q, answer)
        return answer

    return method


def _value_read(name: str):
    """int's method `name` on a SymSize, noted as a read of the value (`size_reads`)."""
    method = getattr(int, name)

    def read(self, *args):
        size_reads.note_read(name)
        return method(self, *args)

    return read


_VALUE_READS = ("__int__", "__index__", "__float__", "__str__", "__repr__", "__format__", "__truediv__",
                "__rtruediv__", "__pow__", "__rpow__", "__and__", "__rand__", "__or__", "__ror__", "__xor__",
                "__rxor__", "__lshift__", "__rlshift__", "__rshift__", "__rrshift__", "__invert__", "__abs__",
                "__divmod__", "__rdivmod__", "__round__", "__trunc__", "__floor__", "__ceil__", "bit_length",
                "bit_count", "to_bytes", "as_integer_ratio", "conjugate")
"""The methods of int through which a SymSize's value is read (`_value_read`)."""

_NOT_NUMBERS = (type(None), str, bytes, tuple, list, dict, set, frozenset)
"""What a SymSize compares unequal to without reading its value."""

_COMPARISONS = {"eq": operator.eq, "ne": operator.ne, "lt": operator.lt, "le": operator.le,
                "gt": operator.gt, "ge": operator.ge}


def guards_hold(guards, values: dict[str, int]) -> bool:
    """Whether every guard of `guards` (`size_reads.SizeReads.guards`) answers as it did with
    the size variables at `values` (name -> int; all of the guards' variables): comparisons
    first, then checks (`size_reads.note_check`), which may compute."""
    found: dict[tuple, int] = {}       # guards share sides: each polynomial evaluated once

    def value(p: tuple) -> int:
        if p not in found:
            found[p] = _value(p, values)
        return found[p]
    checks = [(p, answer) for op, p, _, answer in guards if op == "check"]
    return (all(_COMPARISONS[op](value(p), value(q)) == answer for op, p, q, answer in guards if op != "check")
            and all(bool(check(values)) == answer for check, answer in checks))


def pinned(name: str, value: int) -> tuple:
    """The guard (as `size_reads.SizeReads.guards` holds them) that holds where the size
    variable `name` is `value` and nowhere else."""
    return ("eq", SymSize.named(name, value).polynomial, _constant(value), True)


def guard_variables(guard: tuple) -> set[str]:
    """The names of the size variables a guard of `size_reads.SizeReads.guards` reads."""
    op, p, q, _ = guard
    return set(q) if op == "check" else set(variables(p)) | set(variables(q))


def variables(polynomial: tuple) -> dict[str, int]:
    """The size variables `polynomial` (a SymSize's, a guard's side) reads, with their values
    in its trace, by name (those inside floor divisions and remainders included)."""
    found = {}
    for monomial, _ in polynomial:
        for atom in monomial:
            if atom[0] == "size":
                found[atom[1]] = atom[2]
            else:
                found.update(variables(atom[1]))
                found.update(variables(atom[2]))
    return found


def value_at(size, values: dict[str, int]) -> int:
    """`size` (an int, or a SymSize) with the size variables at `values` (name -> int)."""
    return _value(size.polynomial, values) if isinstance(size, SymSize) else size


def moved_to(size, values: dict[str, int]):
    """`size` (an int, or a SymSize) as it would be in a trace where the size variables are at
    `values` (name -> int; the others keep theirs): the same expression, of its value there."""
    if not isinstance(size, SymSize):
        return size
    polynomial = _moved(size.polynomial, values)
    return _make(_value(polynomial), polynomial)


def _moved(p: tuple, values: dict[str, int]) -> tuple:
    def atom(a: tuple) -> tuple:
        if a[0] == "size":
            return ("size", a[1], _int(values.get(a[1], a[2])))
        return (a[0], _moved(a[1], values), _moved(a[2], values))
    return _normal((tuple(sorted(atom(a) for a in m)), c) for m, c in p)


class SymSize(int):
    """A size known by its value in this trace and by its expression over run-time sizes
    (see the module doc). `SymSize.named(name, value)` makes the size variable itself."""

    def __new__(cls, value: int, polynomial: tuple):
        self = super().__new__(cls, value)
        self.polynomial = polynomial
        self._expr = None
        return self

    @classmethod
    def named(cls, name: str, value: int) -> SymSize:
        """The run-time size `name`, of `value` in this trace."""
        return cls(_int(value), (((("size", name, _int(value)),), 1),))

    def size_expr(self) -> Expr:
        """The int64 IR expression computing this size from `SizeVar`s."""
        if self._expr is None:
            self._expr = _expr_of(self.polynomial)
        return self._expr

    __add__, __radd__ = _binary("add", _add)
    __sub__, __rsub__ = _binary("sub", _sub)
    __mul__, __rmul__ = _binary("mul", _mul)
    __floordiv__, __rfloordiv__ = _binary("floordiv", _floordiv)
    __mod__, __rmod__ = _binary("mod", _mod)

    def __neg__(self):
        return _make(-_int(self), _scale(self.polynomial, -1))

    def __pos__(self):
        return self

    __eq__, __ne__, __lt__, __le__, __gt__, __ge__ = (_comparison(name) for name in _COMPARISONS)

    def __bool__(self):
        return self != 0

    __hash__ = _value_read("__hash__")     # set here: a class defining __eq__ has none

    def __reduce__(self):       # pickled as its value
        return (int, (_int(self),))

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self


for _name in _VALUE_READS:
    setattr(SymSize, _name, _value_read(_name))


def _atom_expr(atom: tuple) -> Expr:
    if atom[0] == "size":
        return SizeVar(atom[1], atom[2])
    return Binary(_ATOM_OPS[atom[0]][0], _expr_of(atom[1]), _expr_of(atom[2]), dtypes.int64)


def _expr_of(p: tuple) -> Expr:
    out = None
    for monomial, coef in p:
        term = None
        for atom in monomial:
            a = _atom_expr(atom)
            term = a if term is None else Binary(BinaryOp.MUL, term, a, dtypes.int64)
        if term is None:
            term = Const(coef, dtypes.int64)
        elif coef != 1:
            term = Binary(BinaryOp.MUL, term, Const(coef, dtypes.int64), dtypes.int64)
        out = term if out is None else Binary(BinaryOp.ADD, out, term, dtypes.int64)
    return out if out is not None else Const(0, dtypes.int64)


def size_text(size) -> str:
    """A size as message text: a plain int's digits, a SymSize's expression over its size
    names (`s0 * 2`), the same at every value, so that a kernel whose error message names a
    size keeps one source across sizes."""
    if not isinstance(size, SymSize):
        return str(int(size))

    def atom(a: tuple) -> str:
        return a[1] if a[0] == "size" else f"({text(a[1])} {'//' if a[0] == 'floordiv' else '%'} {text(a[2])})"

    def text(p: tuple) -> str:
        terms = [" * ".join([atom(a) for a in monomial] + ([str(coef)] if coef != 1 or not monomial else []))
                 for monomial, coef in p]
        return " + ".join(terms) or "0"
    return text(size.polynomial)


def scaled_variable(term: Expr) -> tuple[Var, int] | None:
    """(v, c) where the expression `term` is the index variable v times a product c of
    symbolic sizes (c a `SymSize` computing that product; 1 for v alone), else None."""
    factors, stack = [], [term]
    while stack:
        e = stack.pop()
        if isinstance(e, Binary) and e.op == BinaryOp.MUL:
            stack += [e.a, e.b]
        else:
            factors.append(e)
    variables = [f for f in factors if isinstance(f, Var)]
    if len(variables) != 1 or any(not isinstance(f, (Var, SizeVar)) for f in factors):
        return None
    return variables[0], math.prod((SymSize.named(f.name, f.traced) for f in factors if isinstance(f, SizeVar)), start=1)


def as_dim(size) -> int:
    """A dimension as shapes hold it: a SymSize as it is, anything else as an int."""
    return size if isinstance(size, SymSize) else int(size)


def as_index(value) -> int:
    """`operator.index(value)`, keeping a SymSize as it is."""
    return value if isinstance(value, SymSize) else operator.index(value)


def slice_extent(start, end, step: int, n) -> tuple:
    """(first index, count) of Python's slice `start:end:step` (a positive step) over a
    dimension of `n`, as `slice(...).indices(n)` decides them, kept symbolic where the bounds
    and `n` are: `x[1:]` of a SymSize n has n - 1 elements."""
    def bound(value, default):
        if value is None:
            return default
        value = as_index(value)
        if value < 0:
            value = value + n
            return value if value >= 0 else 0
        return value if value <= n else n

    first, stop = bound(start, 0), bound(end, n)
    count = (stop - first + step - 1) // step if stop > first else 0
    return first, count


def distinct(values) -> list:
    """`values` (sizes, or tuples of them) without repeats, in order, told apart by `!=`: a
    SymSize compares as a guard where hashing it would read its value (`size_reads`)."""
    out = []
    for v in values:
        if all(v != w for w in out):
            out.append(v)
    return out


def size_key(value):
    """`value` (a size, or a list or tuple holding sizes) as a hashable key that tells a
    SymSize from an int of the same value, and SymSizes of different expressions apart."""
    if isinstance(value, SymSize):
        return ("symsize", _int(value), value.polynomial)
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(size_key(v) for v in value))
    return value
