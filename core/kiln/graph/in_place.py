"""The two operators of an in-place update: the new elements, and their store into the input.

An operator declaring the trait `updates` (`kiln.graph.Traits`) returns one of its arguments
with some elements replaced. Where a graph updates one of its inputs so (the value is written
back into the caller's tensor) and nothing reads the input's old value afterwards,
`kiln.passes.in_place` replaces the node by

- `UpdateRows(<the node's arguments>)`: the replaced elements, from the sources' side, and
  their flat offsets in the input (two outputs of the sources' shape: the values in the input's
  dtype, the offsets int64, checked in range as the operator checks its indices): an ordinary
  task, fused with whatever computes its sources;
- `StoreRows(xs, rows, wheres)`: each x with its elements stored (lists, one entry per updated
  input: the updates of one graph step, a K and a V cache, store in one launch). Its task is
  marked STORES_ROWS (`kiln.schedule.store_rows`): the compiled graph gives each output its
  input's own buffer, and its kernel writes only the new elements there.

Both are definitions of the core, not operators of a plugin (no registry knows them). An
UpdateRows task whose offsets are distinct for any index values (every source dim longer than 1
is a dim of the input, unmoved: a decoding step's one position) says so (its attribute
DISTINCT_OFFSETS); the kernel computing its rows may then store them itself (`storing_rows`,
`kiln.passes.row_stores`), and StoreRows has nothing left to do.

Where an element-wise kernel computes the whole new value from the input itself (a counter's
`add_(1)`), the pass keeps the node and marks it instead (`storing_into`: the node attribute
STORED_INTO): the compiled graph gives that output its input's buffer, and the kernel writes
each element where it read it. `stored_into(node)` says, for either kind, which outputs go
into which inputs' buffers.
"""
from __future__ import annotations

import math

from kiln import dtypes
from kiln.graph.operator import Operator, OperatorDef, Recent, operator
from kiln.ir import ReduceOp, TensorInput, Var, cast, compute, eq, maximum, reduce, select, size_key, unravel
from kiln.ir.compute import Task
from kiln.ir.row_stores import ROW_STORES
from kiln.schedule.store_rows import STORES_ROWS
from kiln.tensor import Tensor


def _no_definition(**arguments):
    raise TypeError("UpdateRows nodes are made by kiln.passes.in_place, from an operator's `updates` trait")


ROWS = OperatorDef("update_rows", _no_definition, display_name="UpdateRows")
"""The definition UpdateRows nodes carry (their tasks are made from another operator's trait)."""

DISTINCT_OFFSETS = "distinct_offsets"
"""The attribute (set True) of an UpdateRows task whose offsets are distinct, whatever its
inputs hold."""


def _row_major(shape) -> list[int]:
    strides, inner = [], 1
    for size in reversed(shape):
        strides.append(inner)
        inner *= size
    return strides[::-1]


def _stored(x, rows, where):
    """x with rows[i] at the flat offset where[i] (the later i where two are equal)."""
    n = math.prod(rows.shape)
    strides = _row_major(x.shape)

    def element(*p):
        flat = sum((i * s for i, s in zip(p, strides)), 0)
        last = reduce([n], lambda j: select(eq(where[unravel(j, where.shape)], flat), j, -1), ReduceOp.MAX, dtypes.int64)
        return select(last >= 0, rows[unravel(maximum(last, 0), rows.shape)], x[p])

    return compute(x.shape, element)


@operator("store_rows", display_name="StoreRows")
def store_rows(xs, rows, wheres, stores_rows=True):
    """Each xs[k] with rows[k][i] at the flat offset wheres[k][i] (the later i where two are
    equal)."""
    return tuple(_stored(x, r, w) for x, r, w in zip(xs, rows, wheres))


def arguments(task: Task, definition: OperatorDef) -> dict | None:
    """The definition's arguments of `task`, by parameter name (tensors as the task's
    `TensorInput`s, a list of them where `OperatorDef.task` numbered them), or None where the
    task's inputs and attributes are not those of one call."""
    inputs = {t.name: t for t in task.inputs}
    found = {}
    for name in definition.signature.parameters:
        if name in task.attrs:
            found[name] = task.attrs[name]
        elif name in inputs:
            found[name] = inputs.pop(name)
        elif f"{name}0" in inputs:
            found[name] = [inputs.pop(f"{name}{k}") for k in range(len(task.inputs)) if f"{name}{k}" in inputs]
    return None if inputs else found


def update_rows(node: Operator) -> tuple[Operator, int] | None:
    """The UpdateRows node replacing `node` (an operator declaring `updates`, whose call only
    replaces elements) and the position among its inputs of the tensor it updates; None where
    the node is not such a call, or the updated tensor or the sources have sizes that are not
    fixed, or no dims."""
    update_of = node.definition.traits.updates
    if update_of is None or len(node.outputs) != 1:
        return None
    found = arguments(node.task, node.definition)
    update = update_of(**found) if found is not None else None
    if update is None or not isinstance(update.target, TensorInput):
        return None
    x = update.target
    position = next((k for k, t in enumerate(node.task.inputs) if t is x), None)
    sources = tuple(update.sources)
    if (position is None or not x.shape or not all(type(d) is int for d in (*x.shape, *sources))
            or tuple(node.outputs[0].shape) != tuple(x.shape) or node.outputs[0].dtype != x.dtype):
        return None
    strides = _row_major(x.shape)
    axes = [Var(f"s{k}", extent) for k, extent in enumerate(sources)]
    place = update.position(axes)
    distinct = all(extent == 1 or any(p is axis for p in place) for axis, extent in zip(axes, sources))

    def offset(*s):
        place = update.position(list(s))
        return cast(sum((i * stride for i, stride in zip(place, strides)), 0), dtypes.int64)

    rows = compute(sources, lambda *s: cast(update.value(list(s)), x.dtype), name="new_rows")
    where = compute(sources, offset, name="row_offsets")
    task = Task(ROWS.name, list(node.task.inputs), [rows, where], {**node.task.attrs, DISTINCT_OFFSETS: distinct})
    return Operator(ROWS, node.inputs, node.attrs, task, node.device), position


def is_store(node: Operator) -> bool:
    """Whether `node` is a StoreRows node (its k-th output is its k-th input's buffer)."""
    return node.definition is store_rows and node.attrs.get(STORES_ROWS) is True


STORED_INTO = "stored_into"
"""The node attribute of a node whose outputs are stored into inputs' buffers (`storing_into`):
((output position, input position), ...)."""


def stored_into(node: Operator) -> dict[int, int]:
    """The positions of the outputs of `node` that the compiled graph puts into the buffer of
    one of its inputs, each with that input's position: every output of a StoreRows node
    (into the input of its own position), the outputs `storing_into` and `storing_rows` marked."""
    if is_store(node):
        return {k: k for k in range(len(node.outputs))}
    return dict(node.attrs.get(STORED_INTO, ()))


def storing_into(node: Operator, output: int, position: int) -> Operator:
    """A copy of `node` (a plain or a fused node, with outputs of its own) whose output `output`
    the compiled graph puts into the buffer of its input at `position`, besides those `node`
    stores so already. Only for a kernel that reads that input's element p where it writes the
    output's element p, and nowhere else (`kiln.passes.in_place_elements`)."""
    return _copy(node, node.task, node.inputs, node.outputs, {**stored_into(node), output: position})


def _copy(node: Operator, task: Task, inputs: list[Tensor], outputs: list[Tensor], into: dict[int, int]) -> Operator:
    """A copy of `node` computing `task` from `inputs`, with new outputs like `outputs`, which
    the compiled graph puts into the buffers of inputs as `into` says (output -> input)."""
    marked = object.__new__(type(node))
    marked.__dict__.update(node.__dict__)
    marked.task, marked.inputs = task, list(inputs)
    marked.attrs = {**node.attrs, STORED_INTO: tuple(sorted(into.items()))}
    marked.outputs = [Tensor(t.shape, t.dtype, node.device, trace=(marked, k)) for k, t in enumerate(outputs)]
    return marked


STORED_TASKS_KEPT = 1024
"""The most tasks with row stores kept for reuse (`storing_rows`): the layers of a model store
their rows with one task."""

_stored_tasks = Recent(lambda: STORED_TASKS_KEPT)


def storing_rows(node: Operator, x: Tensor, rows: int, offsets: int) -> Operator:
    """A copy of `node` (a plain or a fused node, its outputs `rows` and `offsets` an UpdateRows
    node's, with DISTINCT_OFFSETS) that also stores those rows into `x`, a graph input, in its
    kernel (`kiln.ir.row_stores`): it reads `x` as one more input, and its one more output is
    `x` updated, which the compiled graph puts into `x`'s buffer. Only where nothing reads `x`
    or a view of it in `node` or after it (`kiln.passes.row_stores`)."""
    key = (id(node.task), rows, offsets, size_key(x.shape), x.dtype.name)
    found = _stored_tasks.get(key)
    if found is None:
        task = node.task
        into = TensorInput(f"in{len(task.inputs)}", x.shape, x.dtype)
        stored = _stored(into, task.outputs[rows], task.outputs[offsets])
        stores = (*task.attrs.get(ROW_STORES, ()), (len(task.outputs), rows, offsets))
        found = (task, Task(task.name, [*task.inputs, into], [*task.outputs, stored], {**task.attrs, ROW_STORES: stores}))
        _stored_tasks.put(key, found)
    into = {**stored_into(node), len(node.outputs): len(node.inputs)}
    return _copy(node, found[1], [*node.inputs, x], [*node.outputs, x], into)
