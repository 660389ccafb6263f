"""Inlining of injective computes: the first step of every schedule.

A compute that reduces, or that is an output of the task, is *materialized* (written to a
buffer). Every other compute is injective and is substituted into its consumers, so a chain of
element-wise operators becomes one expression.
"""
from __future__ import annotations

from typing import Sequence

from kiln.ir.compute import Compute, Task, TensorInput, TensorNode
from kiln.ir.expr import Expr, Load, Reduce, Var
from kiln.ir.rewrite import rewrite
# Re-exported: kiln.schedule's rewriters import them from here (they belong to kiln.ir.rewrite).
from kiln.ir.rewrite import own_children, rebuild_expr  # noqa: F401,E402
from kiln.ir.simplify import simplify


def substitute(expr: Expr, mapping: dict[int, Expr], memo: dict | None = None,
               loads: dict[int, TensorNode] | None = None) -> Expr:
    """Replace variables (by id) with expressions and, if given, loaded tensors (by id).

    A reduction axis whose extent is an expression gets a new axis of the rewritten extent, once:
    copies of a reduction (as simplification leaves in two index expressions) share its axis
    and parts of its body, which are rewritten once (`memo`) and read that one new axis."""
    mapping = dict(mapping)
    loads = loads or {}
    memo = {} if memo is None else memo
    renamed: dict[int, Var] = {}

    def axis(a: Var) -> Var:
        if id(a) not in renamed:
            renamed[id(a)] = Var(a.name, rewrite(a.extent, post, pre, memo))
            mapping[id(a)] = renamed[id(a)]
        return renamed[id(a)]

    def pre(e: Expr) -> Expr | None:
        if isinstance(e, Var):
            return mapping.get(id(e), e)
        if isinstance(e, Reduce) and any(isinstance(a.extent, Expr) for a in e.axes):
            axes = [axis(a) if isinstance(a.extent, Expr) else a for a in e.axes]
            return Reduce(e.op, axes, rewrite(e.body, post, pre, memo), e.dtype)
        return None

    def post(e: Expr) -> Expr:
        if isinstance(e, Load) and id(e.tensor) in loads:
            return Load(loads[id(e.tensor)], e.indices)
        return e

    return rewrite(expr, post, pre, memo)


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

    def inlined_loads(e: Expr) -> Expr:
        """A load of an injective compute becomes its (already rewritten) value."""
        if not isinstance(e, Load):
            return e
        t = e.tensor
        if isinstance(t, Compute) and id(t) not in inlined:
            return substitute(injective[id(t)], {id(a): i for a, i in zip(t.axes, e.indices)})
        return Load(inlined[id(t)], e.indices) if id(t) in inlined else e

    injective: dict[int, Expr] = {}
    for node in task.nodes():
        if not isinstance(node, Compute):
            continue
        value = rewrite(node.value, inlined_loads)
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
