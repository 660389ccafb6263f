"""Whether a task is an operator's own: the computes its definition builds for these inputs and
attributes, with nothing fused in.

A template that computes an operator by another algorithm than its compute definition (a
sorting network for a rank count, atomics for a gather) cannot read the task's structure the
way the contraction templates do (`kiln.codegen.hooks`); it takes exactly the tasks the
definition builds and declines the rest: a fused task, or another plugin's operator of the same
name. `own_call(task, definition)` rebuilds the definition's computes on the task's inputs and
compares the two structurally (names and identities aside), and returns the call's arguments.
A template that runs its own code around a task's reduction but takes the epilogues fused
after it (a convolution, a pool) checks that reduction alone with `same_reduction`.
"""
from __future__ import annotations

import inspect
import threading
import weakref
from typing import Callable, Protocol

from kiln.template import (Compute, Const, Expr, Load, Task, TensorInput, Var, dtypes, inline_task, simplify,
                           substitute, top_reduces)


class Definition(Protocol):
    """What `own_call` reads of an operator definition (`kiln.graph.OperatorDef`, which the
    `@operator` decorator makes): its name, its function and that function's signature."""

    name: str
    definition: Callable
    signature: inspect.Signature


_found: "weakref.WeakKeyDictionary[Task, dict | None]" = weakref.WeakKeyDictionary()
_lock = threading.Lock()      # kernels are built by several threads (kiln.graph.compile)


def _arguments(task: Task, definition: Definition) -> dict | None:
    """The definition's arguments of `task` by parameter name (tensor inputs as the task's
    `TensorInput`s, a list of them where `OperatorDef.task` numbered them `name0, name1, ..`),
    or None when the task's inputs and attributes are not exactly those of one call."""
    inputs = {t.name: t for t in task.inputs}
    arguments = {}
    for name in definition.signature.parameters:
        if name in task.attrs:
            arguments[name] = task.attrs[name]
        elif name in inputs:
            arguments[name] = inputs.pop(name)
        elif f"{name}0" in inputs:
            arguments[name] = [inputs.pop(f"{name}{k}") for k in range(len(task.inputs)) if f"{name}{k}" in inputs]
    if inputs or set(task.attrs) - set(arguments):
        return None
    return arguments


def _structure(task: Task, table: dict) -> list[int]:
    """The outputs of `task` as numbers, equal between two tasks (sharing `table`) exactly where
    they compute the same: inputs by position, index variables by order of first use."""
    memo: dict[int, int] = {}
    variables: dict[int, int] = {}
    positions = {id(t): k for k, t in enumerate(task.inputs)}

    def number(label) -> int:
        return table.setdefault(label, len(table))

    def value(v):
        if isinstance(v, Expr):
            return expr(v)
        if isinstance(v, (tuple, list)):
            return tuple(value(x) for x in v)
        return repr(v)

    def expr(e: Expr) -> int:
        if id(e) in memo:
            return memo[id(e)]
        if isinstance(e, Var):
            label = ("var", variables.setdefault(id(e), len(variables)), value(e.extent))
        elif isinstance(e, Load):
            label = ("load", tensor(e.tensor), value(e.indices))
        else:
            slots = [s for cls in type(e).__mro__ for s in getattr(cls, "__slots__", ()) if s not in ("dtype", "_key")]
            label = (type(e).__name__, e.dtype.name) + tuple(value(getattr(e, s)) for s in slots)
        memo[id(e)] = number(label)
        return memo[id(e)]

    def tensor(t) -> int:
        if id(t) not in memo:
            if isinstance(t, TensorInput):
                label = ("input", positions[id(t)], t.shape, t.dtype.name)
            else:
                label = ("compute", t.shape, t.dtype.name, value(t.axes), expr(t.value))
            memo[id(t)] = number(label)
        return memo[id(t)]

    return [tensor(t) for t in task.outputs]


def own_call(task: Task, definition: Definition) -> dict | None:
    """The arguments (by parameter name) of the call of `definition` whose own task `task` is,
    or None where it is not one (fused, another operator's, built otherwise)."""
    if task.name != definition.name:
        return None
    with _lock:
        if task in _found:
            return _found[task]
    arguments = None
    call = _arguments(task, definition)
    try:
        built = definition.definition(**call) if call is not None else None
    except (ValueError, TypeError, KeyError):
        built = None
    if built is not None:
        outputs = list(built) if isinstance(built, (tuple, list)) else [built]
        table: dict = {}
        if _structure(task, table) == _structure(Task(task.name, task.inputs, outputs), table):
            arguments = call
    with _lock:
        _found[task] = arguments
    return arguments


def same_values(inputs: list[TensorInput], a: Compute, b: Compute) -> bool:
    """Whether computes `a` and `b`, which may read only `inputs`, compute the same element at
    each index (their axes matched by position; names and identities aside)."""
    try:
        tasks = Task("a", inputs, [a]), Task("b", inputs, [b])
    except ValueError:           # one reads a tensor that is not one of `inputs`
        return False
    table: dict = {}
    return _structure(tasks[0], table) == _structure(tasks[1], table)


def _unit_axes_zero(axes, e):
    """`e` with the axes of extent 1 replaced by 0 (fusion may have done so, or not)."""
    return simplify(substitute(e, {id(a): Const(0, dtypes.int64) for a in axes if a.extent == 1}))


def same_reduction(inputs: list[TensorInput], out: Compute, ref: Compute) -> bool:
    """Whether the top reduction of `out` (a task's output, inlined: epilogues around it) is the
    one of `ref` (what an operator's definition builds on `inputs`), axes of extent 1 aside."""
    ref_out = inline_task(Task("ref", inputs, [ref])).outputs[0]
    return ref_out.shape == out.shape and same_values(
        inputs, *(Compute(name, t.axes, _unit_axes_zero(t.axes, top_reduces(t.value)[0])) for name, t in (("a", out), ("b", ref_out))))
