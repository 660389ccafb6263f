"""Tensor nodes of the compute IR and the Task that groups them.

A `TensorInput` is a named input; a `Compute` defines every element of a tensor by a scalar
expression of its index variables. `tensor[i, j]` reads an element, so computes chain:

    y = compute(x.shape, lambda i, j: maximum(x[i, j], 0))
"""
from __future__ import annotations

import itertools
from typing import Callable, Sequence

from kiln import dtypes
from kiln.dtypes import DataType
from kiln.ir.expr import Expr, Load, Reduce, Var, as_expr, cast, walk
from kiln.ir.row_stores import computed_outputs
from kiln.ir.size import as_dim

_names = itertools.count()


class TensorNode:
    """A tensor of the IR: a shape of ints (`kiln.ir.size.SymSize`s where a size changes from
    run to run) and an element type."""

    def __init__(self, name: str, shape: Sequence[int], dtype: DataType):
        self.name = name
        self.shape = tuple(as_dim(s) for s in shape)
        self.dtype = dtypes.data_type(dtype)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __getitem__(self, indices) -> Expr:
        if not isinstance(indices, (tuple, list)):
            indices = (indices,)
        if len(indices) == 1 and isinstance(indices[0], (tuple, list)):
            indices = tuple(indices[0])
        return Load(self, indices)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name}: {self.dtype}{list(self.shape)})"


class TensorInput(TensorNode):
    """An input of a task."""


class Compute(TensorNode):
    """A tensor whose element at `axes` is `value`."""

    def __init__(self, name: str, axes: Sequence[Var], value: Expr):
        super().__init__(name, [a.extent for a in axes], value.dtype)
        self.axes = tuple(axes)
        self.value = value

    @property
    def has_reduce(self) -> bool:
        """Whether computing one element reduces over other elements."""
        return any(isinstance(e, Reduce) for e in walk(self.value))

    def producers(self) -> list[TensorNode]:
        """The tensor nodes this compute reads, in first-seen order."""
        seen = {}
        for e in walk(self.value):
            if isinstance(e, Load):
                seen.setdefault(id(e.tensor), e.tensor)
        return list(seen.values())


def compute(shape: Sequence[int], fcompute: Callable[..., Expr], name: str | None = None,
            dtype=None) -> Compute:
    """Define a tensor of `shape` whose element at index (i0, i1, ...) is `fcompute(i0, i1, ...)`.

    `dtype` converts the value to that type; Python scalars get their default type.
    """
    shape = [as_dim(s) for s in shape]
    if any(s < 0 for s in shape):
        raise ValueError(f"negative dimension in shape {shape}")
    axes = [Var(f"i{k}", s) for k, s in enumerate(shape)]
    value = as_expr(fcompute(*axes))
    if dtype is not None:
        value = cast(value, dtype)
    return Compute(name or f"t{next(_names)}", axes, value)


class Task:
    """A compute definition with named inputs and outputs: the unit that gets scheduled."""

    def __init__(self, name: str, inputs: Sequence[TensorInput], outputs: Sequence[TensorNode],
                 attrs: dict | None = None):
        self.name = name
        self.inputs = list(inputs)
        self.outputs = list(outputs)
        self.attrs = dict(attrs or {})
        self._derived: dict[tuple, object] = {}
        known = {id(t) for t in self.inputs}
        for node in self.nodes():
            if isinstance(node, TensorInput) and id(node) not in known:
                raise ValueError(f"task '{name}' reads tensor '{node.name}' that is not one of its inputs")

    def nodes(self) -> list[TensorNode]:
        """All tensor nodes reachable from the outputs, producers before consumers (found once:
        fusion composes each candidate group from its members' nodes)."""
        return list(self.derived(_nodes))

    def derived(self, compute: Callable[..., object], *args):
        """`compute(self, *args)`, computed once: what schedules derive from a task (its
        contraction, say) is asked for by every template's `applies`, `suggest` and `render`, and
        by fusion of each candidate group. A task does not change once built."""
        key = (compute, *args)
        if key not in self._derived:
            self._derived[key] = compute(self, *args)
        return self._derived[key]

    @property
    def is_injective(self) -> bool:
        """True when no compute of the task reduces (found once); outputs it stores rows into
        (`kiln.ir.row_stores`), which no kernel computes, do not count."""
        return self.derived(_is_injective)

    def __repr__(self) -> str:
        ins = ", ".join(f"{t.name}: {t.dtype}{list(t.shape)}" for t in self.inputs)
        outs = ", ".join(f"{t.dtype}{list(t.shape)}" for t in self.outputs)
        return f"Task {self.name}({ins}) -> {outs}"


def _nodes(task: Task) -> tuple[TensorNode, ...]:
    return reachable(task.outputs)


def reachable(outputs: Sequence[TensorNode]) -> tuple[TensorNode, ...]:
    """The tensor nodes reachable from `outputs`, producers before consumers."""
    order, seen = [], set()

    def visit(node):
        if id(node) in seen:
            return
        seen.add(id(node))
        if isinstance(node, Compute):
            for p in node.producers():
                visit(p)
        order.append(node)

    for out in outputs:
        visit(out)
    return tuple(order)


def _is_injective(task: Task) -> bool:
    return not any(isinstance(n, Compute) and n.has_reduce for n in reachable(computed_outputs(task)))
