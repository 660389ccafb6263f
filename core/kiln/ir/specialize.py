"""A task with its symbolic sizes fixed to their values in the trace, for schedules that build
kernels for one size only.

A schedule that does not take sizes as kernel arguments gets `specialize(task)`: the same task
with every `SymSize` a plain int and every `SizeVar` a constant, exactly the task a trace of
those sizes without symbols would have made; its kernel's source holds the sizes.
"""
from __future__ import annotations

from kiln import dtypes
from kiln.ir.compute import Compute, Task, TensorInput, TensorNode
from kiln.ir.expr import Const, Expr, Load, Reduce, SizeVar, Var, walk
from kiln.ir.rewrite import rewrite
from kiln.ir.size import SymSize


def has_symbolic_sizes(task: Task) -> bool:
    """Whether a shape, an extent or an expression of `task` holds a symbolic size."""
    return task.derived(_has_symbolic_sizes)


def _has_symbolic_sizes(task: Task) -> bool:
    nodes = task.nodes()
    return any(isinstance(s, SymSize) for node in nodes for s in node.shape) or any(
        isinstance(x, SizeVar) for node in nodes if isinstance(node, Compute) for x in walk(node.value))


def _fixed(value):
    if isinstance(value, SymSize):
        return int(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_fixed(v) for v in value)
    if isinstance(value, dict):
        return {k: _fixed(v) for k, v in value.items()}
    return value


def specialize(task: Task) -> Task:
    """`task` with its sizes fixed to their values (`task` itself where it has no symbolic
    size; see the module doc). Built once per task."""
    return task.derived(_specialize) if has_symbolic_sizes(task) else task


def _specialize(task: Task) -> Task:
    tensors: dict[int, TensorNode] = {}
    variables: dict[int, Var] = {}

    def new_var(v: Var) -> Var:
        extent = rewrite(v.extent, post, pre) if isinstance(v.extent, Expr) else int(v.extent)
        variables[id(v)] = Var(v.name, extent)
        return variables[id(v)]

    def pre(e: Expr) -> Expr | None:
        if isinstance(e, Var):
            return variables.get(id(e), e)
        if isinstance(e, SizeVar):
            return Const(e.value, dtypes.int64)
        if isinstance(e, Reduce):
            axes = [new_var(a) for a in e.axes]
            return Reduce(e.op, axes, rewrite(e.body, post, pre), e.dtype)
        return None

    def post(e: Expr) -> Expr:
        if isinstance(e, Load) and id(e.tensor) in tensors:
            return Load(tensors[id(e.tensor)], e.indices)
        return e

    for node in task.nodes():
        if isinstance(node, TensorInput):
            tensors[id(node)] = TensorInput(node.name, [int(s) for s in node.shape], node.dtype)
        elif isinstance(node, Compute):
            axes = [new_var(a) for a in node.axes]
            tensors[id(node)] = Compute(node.name, axes, rewrite(node.value, post, pre))
    inputs = [tensors[id(t)] for t in task.inputs]
    outputs = [tensors.get(id(t), t) for t in task.outputs]
    return Task(task.name, inputs, outputs, _fixed(task.attrs))
