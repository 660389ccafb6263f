"""Rewriting expressions: the one traversal every expression rewriter of Kiln is built on.

`rewrite(expr, post, pre=...)` visits each distinct node once (a memo keyed by node identity,
so shared sub-expressions stay shared and DAGs do not blow up), without recursion (deep
element-wise chains do not hit Python's recursion limit):

- `pre(node)`, when given, is called before the node's children; a result other than None
  replaces the node as it is (its children are not visited);
- otherwise the node is rebuilt over its rewritten children (the node itself when none
  changed) and `post(rebuilt)`, when given, returns the replacement.

A reduction's own children are its body (`own_children`); its axes and their extents belong to
it and are kept.
"""
from __future__ import annotations

from typing import Callable

from kiln.ir.expr import Binary, Cast, Check, Expr, Load, Reduce, Select, Unary

Rewriter = Callable[[Expr], Expr]


def own_children(e: Expr) -> list[Expr]:
    """The sub-expressions `rebuild_expr` takes back (a reduction's body, not its extents)."""
    if isinstance(e, Reduce):
        return [e.body]
    return list(e.children())


def rebuild_expr(e: Expr, kids: list[Expr]) -> Expr:
    """A copy of the node `e` over new children `kids` (as `own_children(e)` lists them)."""
    if isinstance(e, Load):
        return Load(e.tensor, kids)
    if isinstance(e, Unary):
        return Unary(e.op, kids[0], e.dtype)
    if isinstance(e, Binary):
        return Binary(e.op, kids[0], kids[1], e.dtype)
    if isinstance(e, Cast):
        return Cast(kids[0], e.dtype)
    if isinstance(e, Select):
        return Select(*kids)
    if isinstance(e, Reduce):
        return Reduce(e.op, e.axes, kids[0], e.dtype)
    if isinstance(e, Check):
        return Check(kids[0], kids[1], e.error, e.message, kids[2])
    raise TypeError(f"cannot rebuild {type(e).__name__} over new children")


def rewrite(expr: Expr, post: Rewriter | None = None, pre: Callable[[Expr], Expr | None] | None = None,
            memo: dict | None = None) -> Expr:
    """`expr` rewritten bottom-up by `post` (and top-down by `pre`; see the module doc).

    `memo` (id of a node -> (node, result)) may be shared between calls with the same
    rewriters, so that work on common sub-expressions is done once.
    """
    memo = {} if memo is None else memo
    stack: list[tuple[Expr, bool]] = [(expr, False)]
    while stack:
        e, children_done = stack.pop()
        if id(e) in memo:
            continue
        if not children_done:
            replaced = pre(e) if pre is not None else None
            if replaced is not None:
                memo[id(e)] = (e, replaced)
                continue
            stack.append((e, True))
            stack.extend((k, False) for k in own_children(e) if id(k) not in memo)
            continue
        kids = own_children(e)
        new = [memo[id(k)][1] for k in kids]
        node = e if all(a is b for a, b in zip(new, kids)) else rebuild_expr(e, new)
        memo[id(e)] = (e, post(node) if post is not None else node)
    return memo[id(expr)][1]
