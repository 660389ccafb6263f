"""Simplification of index arithmetic.

Index expressions come out of shape operators as flatten/unflatten chains such as
`((i0 * 12 + i1) // 12, (i0 * 12 + i1) % 12)`. `simplify` rewrites them to `(i0, i1)` using
the ranges of the index variables: linear terms divisible by a divisor move out of `//` and `%`,
and a `//` or `%` whose operand provably lies in [0, c) folds away. Divisors that are symbolic
sizes (`kiln.ir.size`) get the same treatment for terms that are multiples of them.

A symbolic size's range is its value in the trace (`SizeVar.value`), as is an index variable's
over a symbolic extent: a fold holds for the sizes of the trace that made the expression, the
only ones its kernel runs with (a kernel's source is shared between sizes only where it is the
same text, made for each size on its own).
"""
from __future__ import annotations

import math

from kiln.ir.expr import Binary, Cast, Check, Const, Expr, Select, SizeVar, Var
from kiln.ir.opcodes import BinaryOp
from kiln.ir.rewrite import rewrite
from kiln.ir.size import SymSize, as_dim


def bounds(e: Expr) -> tuple[int, int] | None:
    """Inclusive integer bounds of `e`, or None when unknown."""
    if isinstance(e, Const) and e.dtype.is_integer:
        return (e.value, e.value)
    if isinstance(e, Var):
        return (0, as_dim(e.extent) - 1) if isinstance(e.extent, int) else None
    if isinstance(e, SizeVar):
        size = SymSize.named(e.name, e.traced)
        return (size, size)
    if isinstance(e, Cast) and e.dtype.is_integer and e.a.dtype.is_integer:
        return bounds(e.a)
    if isinstance(e, Check):
        return bounds(e.value)
    if not isinstance(e, Binary) or not e.dtype.is_integer:
        return None
    a, b = bounds(e.a), bounds(e.b)
    if a is None or b is None:
        if e.op == BinaryOp.MOD and b is not None and b[0] > 0:
            return (0, b[1] - 1)
        return None
    if e.op == BinaryOp.ADD:
        return (a[0] + b[0], a[1] + b[1])
    if e.op == BinaryOp.SUB:
        return (a[0] - b[1], a[1] - b[0])
    if e.op == BinaryOp.MUL:
        products = [x * y for x in a for y in b]
        return (min(products), max(products))
    if e.op == BinaryOp.FLOORDIV and b[0] > 0:
        return (min(a[0] // b[0], a[0] // b[1]), max(a[1] // b[0], a[1] // b[1]))
    if e.op == BinaryOp.MOD and b[0] > 0:
        return (a[0], a[1]) if a[0] >= 0 and a[1] < b[0] else (0, b[1] - 1)
    if e.op == BinaryOp.MAX:
        return (max(a[0], b[0]), max(a[1], b[1]))
    if e.op == BinaryOp.MIN:
        return (min(a[0], b[0]), min(a[1], b[1]))
    return None


def linear_terms(e: Expr) -> tuple[list[tuple[Expr, int]], int]:
    """Split an integer expression into sum(coeff * term) + constant: ([(term, coeff)], constant)."""
    if isinstance(e, Const):
        return [], e.value
    if isinstance(e, Binary) and e.op in (BinaryOp.ADD, BinaryOp.SUB):
        ta, ca = linear_terms(e.a)
        tb, cb = linear_terms(e.b)
        sign = 1 if e.op == BinaryOp.ADD else -1
        return ta + [(t, sign * c) for t, c in tb], ca + sign * cb
    if isinstance(e, Binary) and e.op == BinaryOp.MUL:
        if isinstance(e.b, Const):
            terms, c = linear_terms(e.a)
            return [(t, k * e.b.value) for t, k in terms], c * e.b.value
        if isinstance(e.a, Const):
            terms, c = linear_terms(e.b)
            return [(t, k * e.a.value) for t, k in terms], c * e.a.value
        for x, size in ((e.a, e.b), (e.b, e.a)):
            scale = _size_term(size)
            if scale is not None:     # x * (c * u), u a product of symbolic sizes: c * (x * u)
                u, c = scale
                terms, k0 = linear_terms(x)
                return [(Binary(BinaryOp.MUL, t, u, e.dtype), k * c) for t, k in terms] + (
                    [(u, k0 * c)] if k0 else []), 0
    return [(e, 1)], 0


def _size_term(e: Expr) -> tuple[Expr, int] | None:
    """(u, c) where `e` is c * u for a product u of symbolic sizes, else None."""
    terms, const = linear_terms(e) if isinstance(e, Binary) else ([(e, 1)], 0)
    if len(terms) != 1 or const or not _size_product(terms[0][0]):
        return None
    return terms[0]


def _size_product(e: Expr) -> bool:
    return isinstance(e, SizeVar) or (isinstance(e, Binary) and e.op == BinaryOp.MUL and _size_product(e.a)
                                      and _size_product(e.b))


def _quotient_terms(m: Binary) -> list[tuple[Expr, int]]:
    """For the remainder m = x % d: (the terms whose coefficient k * factor, beside m's own k,
    make them merge with it into x * k), as (term, factor): (x // c) * c for a constant c (also
    where x is y // e: y // (c*e)), (x // d) * d for a divisor d that is not a constant."""
    x, d, t = m.a, m.b, m.dtype
    if isinstance(d, Const):
        if d.value <= 0:
            return []
        found = [(Binary(BinaryOp.FLOORDIV, x, d, t), d.value)]
        if isinstance(x, Binary) and x.op == BinaryOp.FLOORDIV and isinstance(x.b, Const) and x.b.value > 0:
            found.append((Binary(BinaryOp.FLOORDIV, x.a, Const(x.b.value * d.value, t), t), d.value))
        return found
    q = Binary(BinaryOp.FLOORDIV, x, d, t)
    return [(Binary(BinaryOp.MUL, q, d, t), 1), (Binary(BinaryOp.MUL, d, q, t), 1)]


def _merge_div_mod(merged: dict) -> None:
    """Fold (x // c) * c*k + (x % c) * k into x * k, also where x is y // d and its quotient
    appears as y // (c*d), and (x // d) * d + x % d into x for a symbolic d: the offsets of
    unflatten-then-flatten chains collapse step by step."""
    changed = True
    while changed:
        changed = False
        for key, (m, k) in list(merged.items()):
            if not (isinstance(m, Binary) and m.op == BinaryOp.MOD):
                continue
            q = next((q for q, factor in _quotient_terms(m) if merged.get(q.key(), (None, None))[1] == k * factor),
                     None)
            if q is not None:
                del merged[key], merged[q.key()]
                prev = merged.get(m.a.key())
                merged[m.a.key()] = (m.a, (prev[1] if prev else 0) + k)
                changed = True
                break


def _rebuild(terms: list[tuple[Expr, int]], const: int, like: Expr) -> Expr:
    merged: dict = {}
    for t, k in terms:
        key = t.key()
        prev = merged.get(key)
        merged[key] = (t, (prev[1] if prev else 0) + k)
    _merge_div_mod(merged)
    out = None
    for t, k in merged.values():
        if k == 0:
            continue
        term = t if k == 1 else Binary(BinaryOp.MUL, t, Const(k, like.dtype), like.dtype)
        out = term if out is None else Binary(BinaryOp.ADD, out, term, like.dtype)
    if out is None:
        return Const(const, like.dtype)
    if const:
        out = Binary(BinaryOp.ADD, out, Const(const, like.dtype), like.dtype)
    return out


def _radix_split(terms: list[tuple[Expr, int]], const: int, c: int, e: Binary) -> Expr | None:
    """`e` (x // c or x % c, x = sum(terms) + const) through a divisor g of c that splits x into
    g * high + low with 0 <= low < g: x // c = high // (c / g) and x % c = (high % (c / g)) * g + low.
    A reshape's index of merged dims read back at another grouping: (129 * o + e) // 903, e < 129,
    is o // 7."""
    for g in sorted({math.gcd(c, k) for _, k in terms} - {1, c}, reverse=True):
        high = [(x, k // g) for x, k in terms if k % g == 0]
        low = _rebuild([(x, k) for x, k in terms if k % g != 0], const % g, e)
        lb = bounds(low)
        if not high or lb is None or lb[0] < 0 or lb[1] >= g:
            continue
        t = e.dtype
        quotient = Binary(e.op, _rebuild(high, const // g, e), Const(c // g, t), t)
        quotient = _simplify_int(quotient, quotient.a, quotient.b)
        if e.op == BinaryOp.FLOORDIV:
            return quotient
        return _simplify_int(Binary(BinaryOp.ADD, Binary(BinaryOp.MUL, quotient, Const(g, t), t), low, t),
                             Binary(BinaryOp.MUL, quotient, Const(g, t), t), low)
    return None


def _multiple_of(term: Expr, unit: Expr) -> Expr | None:
    """y where `term` is y * unit (or unit itself: 1), else None."""
    if term.key() == unit.key():
        return Const(1, term.dtype)
    if isinstance(term, Binary) and term.op == BinaryOp.MUL:
        if term.b.key() == unit.key():
            return term.a
        if term.a.key() == unit.key():
            return term.b
    return None


def _symbolic_division(e: Binary, a: Expr, b: Expr) -> Expr | None:
    """`a // b` or `a % b` for a positive divisor b that is not a constant (a symbolic size c*u):
    the terms of a that are multiples of it leave the division ((y*b + r) // b = y + r // b,
    (y*b + r) % b = r % b), and a rest in [0, b) folds away; None where nothing does."""
    t = e.dtype
    bb = bounds(b)
    if bb is None or bb[0] <= 0:
        return None
    unit_terms, unit_const = linear_terms(b)
    whole, whole_const, rest = [], 0, []
    terms, const = linear_terms(a)
    for x, k in terms:
        y = None
        if len(unit_terms) == 1 and not unit_const and k % unit_terms[0][1] == 0:
            y = _multiple_of(x, unit_terms[0][0])
        if y is None:
            rest.append((x, k))
        elif isinstance(y, Const):
            whole_const += y.value * (k // unit_terms[0][1])
        else:
            whole.append((y, k // unit_terms[0][1]))
    rest_expr = _rebuild(rest, const, e)
    rb = bounds(rest_expr)
    folds = rb is not None and 0 <= rb[0] and rb[1] < bb[0]
    if not whole and not whole_const and not folds:
        return None
    if e.op == BinaryOp.MOD:
        return rest_expr if folds else Binary(BinaryOp.MOD, rest_expr, b, t)
    quotient = _rebuild(whole, whole_const, e)
    if folds:
        return quotient
    return _simplify_int(Binary(BinaryOp.ADD, quotient, Binary(BinaryOp.FLOORDIV, rest_expr, b, t), t),
                         quotient, Binary(BinaryOp.FLOORDIV, rest_expr, b, t))


def _simplify_int(e: Binary, a: Expr, b: Expr) -> Expr:
    t = e.dtype
    if isinstance(a, Const) and isinstance(b, Const):
        x, y = a.value, b.value
        fold = {BinaryOp.ADD: lambda: x + y, BinaryOp.SUB: lambda: x - y, BinaryOp.MUL: lambda: x * y,
                BinaryOp.MAX: lambda: max(x, y), BinaryOp.MIN: lambda: min(x, y)}
        if e.op in fold:
            return Const(fold[e.op](), t)
        if e.op == BinaryOp.FLOORDIV and y != 0:
            return Const(x // y, t)
        if e.op == BinaryOp.MOD and y != 0:
            return Const(x % y, t)
    if e.op in (BinaryOp.ADD, BinaryOp.SUB, BinaryOp.MUL):
        terms, const = linear_terms(Binary(e.op, a, b, t))
        return _rebuild(terms, const, e)
    if e.op in (BinaryOp.FLOORDIV, BinaryOp.MOD) and isinstance(b, Const) and b.value > 0:
        c = b.value
        if c == 1:
            return a if e.op == BinaryOp.FLOORDIV else Const(0, t)
        terms, const = linear_terms(a)
        whole = [(x, k // c) for x, k in terms if k % c == 0]
        rest = [(x, k) for x, k in terms if k % c != 0]
        rest_expr = _rebuild(rest, const % c, e)
        whole_const = const // c
        rb = bounds(rest_expr)
        if not (rb is not None and 0 <= rb[0] and rb[1] < c):
            radix = _radix_split(terms, const, c, e)
            if radix is not None:
                return radix
        if e.op == BinaryOp.FLOORDIV:
            if rb is not None and 0 <= rb[0] and rb[1] < c:
                return _rebuild(whole, whole_const, e)
            inner = rest_expr
            if isinstance(inner, Binary) and inner.op == BinaryOp.FLOORDIV and isinstance(inner.b, Const) and inner.b.value > 0:
                inner = Binary(BinaryOp.FLOORDIV, inner.a, Const(inner.b.value * c, t), t)
            elif isinstance(inner, Binary) and inner.op == BinaryOp.MOD and isinstance(inner.b, Const) \
                    and inner.b.value % c == 0:
                inner = Binary(BinaryOp.MOD, Binary(BinaryOp.FLOORDIV, inner.a, b, t), Const(inner.b.value // c, t), t)
            else:
                inner = Binary(BinaryOp.FLOORDIV, inner, b, t)
            return _rebuild(whole + [(inner, 1)], whole_const, e)
        if rb is not None and 0 <= rb[0] and rb[1] < c:
            return rest_expr
        if isinstance(rest_expr, Binary) and rest_expr.op == BinaryOp.MOD and isinstance(rest_expr.b, Const) \
                and rest_expr.b.value % c == 0:
            rest_expr = rest_expr.a
        return Binary(BinaryOp.MOD, rest_expr, b, t)
    if e.op in (BinaryOp.FLOORDIV, BinaryOp.MOD) and not isinstance(b, Const):
        divided = _symbolic_division(e, a, b)
        if divided is not None:
            return divided
    if e.op in (BinaryOp.MAX, BinaryOp.MIN):
        ba, bb = bounds(a), bounds(b)
        if ba is not None and bb is not None:
            if ba[1] <= bb[0]:
                return b if e.op == BinaryOp.MAX else a
            if bb[1] <= ba[0]:
                return a if e.op == BinaryOp.MAX else b
    return e if (a is e.a and b is e.b) else Binary(e.op, a, b, t)


def simplify(expr: Expr, memo: dict | None = None) -> Expr:
    """Return an equivalent, simpler expression (index arithmetic folded).

    `memo` may be shared between calls (see `kiln.ir.rewrite`)."""
    return rewrite(expr, _simplified, memo=memo)


_ORDERINGS = (BinaryOp.LT, BinaryOp.LE, BinaryOp.GT, BinaryOp.GE)


def _simplified(e: Expr) -> Expr:
    """`e`, whose children are simplified already, simplified itself."""
    if isinstance(e, Cast):
        a = e.a
        if isinstance(a, Const):
            return Const(a.value, e.dtype) if not (e.dtype.is_integer and a.dtype.is_float) else e
        return a if a.dtype == e.dtype else e
    if isinstance(e, Select):
        return (e.a if e.cond.value else e.b) if isinstance(e.cond, Const) else e
    if isinstance(e, Check):
        return e.value if isinstance(e.ok, Const) and e.ok.value else e
    if not isinstance(e, Binary):
        return e
    a, b = e.a, e.b
    if e.dtype.is_integer and a.dtype.is_integer and b.dtype.is_integer:
        return _simplify_int(e, a, b)
    if e.op in _ORDERINGS and a.dtype.is_integer:
        ba, bb = bounds(a), bounds(b)
        if ba is not None and bb is not None:
            lo, hi = ba[0] - bb[1], ba[1] - bb[0]  # range of a - b
            truth = {BinaryOp.LT: (hi < 0, lo >= 0), BinaryOp.LE: (hi <= 0, lo > 0),
                     BinaryOp.GT: (lo > 0, hi <= 0), BinaryOp.GE: (lo >= 0, hi < 0)}[e.op]
            if truth[0] or truth[1]:
                return Const(truth[0], e.dtype)
    if e.op in (BinaryOp.AND, BinaryOp.OR):
        for known, other in ((a, b), (b, a)):
            if isinstance(known, Const):
                # and: a true operand leaves the other, a false one decides; or: the reverse
                return other if bool(known.value) == (e.op == BinaryOp.AND) else known
    return e
