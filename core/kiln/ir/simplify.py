"""Simplification of index arithmetic.

Index expressions come out of shape operators as flatten/unflatten chains such as
`((i0 * 12 + i1) // 12, (i0 * 12 + i1) % 12)`. `simplify` rewrites them to `(i0, i1)` using
the ranges of the index variables: linear terms divisible by a divisor move out of `//` and `%`,
and a `//` or `%` whose operand provably lies in [0, c) folds away.
"""
from __future__ import annotations

import math

from kiln.ir.expr import Binary, Cast, Check, Const, Expr, Select, SizeVar, Var
from kiln.ir.opcodes import BinaryOp
from kiln.ir.rewrite import rewrite


def bounds(e: Expr) -> tuple[int, int] | None:
    """Inclusive integer bounds of `e`, or None when unknown."""
    if isinstance(e, Const) and e.dtype.is_integer:
        return (e.value, e.value)
    if isinstance(e, Var):
        return (0, int(e.extent) - 1) if isinstance(e.extent, int) else None
    if isinstance(e, SizeVar):
        return (e.value, e.value)
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
    return [(e, 1)], 0


def _merge_div_mod(merged: dict) -> None:
    """Fold (x // c) * c*k + (x % c) * k into x * k, also where x is y // d and its quotient
    appears as y // (c*d): the offsets of unflatten-then-flatten chains collapse step by step."""
    changed = True
    while changed:
        changed = False
        for key, (m, k) in list(merged.items()):
            if not (isinstance(m, Binary) and m.op == BinaryOp.MOD and isinstance(m.b, Const) and m.b.value > 0):
                continue
            x, c = m.a, m.b.value
            quotients = [Binary(BinaryOp.FLOORDIV, x, m.b, m.dtype)]
            if isinstance(x, Binary) and x.op == BinaryOp.FLOORDIV and isinstance(x.b, Const) and x.b.value > 0:
                quotients.append(Binary(BinaryOp.FLOORDIV, x.a, Const(x.b.value * c, m.dtype), m.dtype))
            q = next((q for q in quotients if merged.get(q.key(), (None, None))[1] == k * c), None)
            if q is not None:
                del merged[key], merged[q.key()]
                prev = merged.get(x.key())
                merged[x.key()] = (x, (prev[1] if prev else 0) + k)
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
