"""Inlining of injective computes: the first step of every schedule.

A compute that reduces, or that is an output of the task, is *materialized* (written to a
buffer). Every other compute is injective and is substituted into its consumers, so a chain of
element-wise operators becomes one expression.
"""
from __future__ import annotations

from typing import Sequence

from kiln.ir.compute import Compute, Task, TensorInput, TensorNode
from kiln.ir.expr import Binary, Cast, Check, Const, Expr, Load, Reduce, Select, Unary, Var
from kiln.ir.simplify import simplify


def substitute(expr: Expr, mapping: dict[int, Expr], memo: dict | None = None,
               loads: dict[int, TensorNode] | None = None) -> Expr:
    """Replace variables (by id) with expressions and, if given, loaded tensors (by id)."""
    memo = {} if memo is None else memo
    mapping = dict(mapping)
    loads = loads or {}

    def sub(e: Expr) -> Expr:
        hit = memo.get(id(e))
        if hit is not None:
            return hit[1]
        if isinstance(e, Var):
            out = mapping.get(id(e), e)
        elif isinstance(e, Const):
            out = e
        elif isinstance(e, Load):
            out = Load(loads.get(id(e.tensor), e.tensor), [sub(i) for i in e.indices])
        elif isinstance(e, Reduce) and any(isinstance(a.extent, Expr) for a in e.axes):
            axes = [Var(a.name, sub(a.extent)) if isinstance(a.extent, Expr) else a for a in e.axes]
            mapping.update({id(a): n for a, n in zip(e.axes, axes)})
            out = Reduce(e.op, axes, sub(e.body), e.dtype)
        else:
            out = rebuild_expr(e, [sub(c) for c in own_children(e)])
        memo[id(e)] = (e, out)
        return out

    return sub(expr)


class Lowered:
    """A task after inlining: materialized computes in order, each reading only task inputs
    and earlier materialized computes."""

    def __init__(self, task: Task, buffers: Sequence[Compute], outputs: Sequence[Compute]):
        self.task = task
        self.inputs: list[TensorInput] = list(task.inputs)
        self.buffers = list(buffers)
        self.outputs = list(outputs)

    @property
    def temporaries(self) -> list[Compute]:
        outs = {id(o) for o in self.outputs}
        return [b for b in self.buffers if id(b) not in outs]


def inline_task(task: Task, materialize: Sequence[TensorNode] = ()) -> Lowered:
    """Inline every injective, non-output compute of `task`; simplify the index arithmetic."""
    keep = {id(o) for o in task.outputs} | {id(m) for m in materialize}
    inlined: dict[int, Compute] = {}   # original materialized compute -> rewritten one
    buffers: list[Compute] = []

    def rewrite(value: Expr) -> Expr:
        """Substitute loads of injective computes by their (already rewritten) values."""
        memo: dict = {}

        def visit(e: Expr) -> Expr:
            hit = memo.get(id(e))
            if hit is not None:
                return hit[1]
            if isinstance(e, Load):
                idx = [visit(i) for i in e.indices]
                t = e.tensor
                if isinstance(t, Compute) and id(t) not in inlined:
                    body = injective[id(t)]
                    out = substitute(body, {id(a): i for a, i in zip(t.axes, idx)})
                else:
                    out = Load(inlined.get(id(t), t), idx)
            elif isinstance(e, (Var, Const)):
                out = e
            else:
                out = rebuild_expr(e, [visit(c) for c in own_children(e)])
            memo[id(e)] = (e, out)
            return out

        return visit(value)

    injective: dict[int, Expr] = {}
    for node in task.nodes():
        if not isinstance(node, Compute):
            continue
        value = rewrite(node.value)
        if id(node) in keep or node.has_reduce:
            new = Compute(node.name, node.axes, simplify(value))
            inlined[id(node)] = new
            buffers.append(new)
        else:
            injective[id(node)] = value
    outputs = []
    for out in task.outputs:
        if isinstance(out, TensorInput):
            raise ValueError(f"task '{task.name}' returns its input '{out.name}' unchanged; "
                             "an operator's outputs must be computed")
        outputs.append(inlined[id(out)])
    return Lowered(task, buffers, outputs)


def own_children(e: Expr) -> list[Expr]:
    """The sub-expressions `rebuild_expr` takes back (a reduction's body, not its extents)."""
    if isinstance(e, Reduce):
        return [e.body]
    return list(e.children())


def rebuild_expr(e: Expr, kids: list[Expr]) -> Expr:
    """A copy of the node `e` over new children `kids` (as `own_children(e)` lists them)."""
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
    raise TypeError(type(e).__name__)
