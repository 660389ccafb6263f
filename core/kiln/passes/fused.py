"""`FusedOperator`: a group of operators run as one kernel.

Its Task is composed from the members' computes: where a member reads a tensor another member
produces, it reads that member's compute instead, so the schedule inlines injective members
and the group compiles to one kernel. Where the anchor's reduction can be folded into the
group's single output, the Task is shaped like the anchor's own (one compute: the epilogue
around the reduction) and carries its name, so the anchor's templates render the epilogue
through their hooks (`kiln.codegen.hooks`). The node keeps its members as a FlowGraph
(`fused_graph`) and the position of its anchor, the reduction or template-scheduled member:

    x_1: float32[2, 2][cpu] = FusedMatmul(x, c, c_1, fused_graph=FlowGraph(Matmul, Add), anchor=0)

`merged(first, second, readers)` makes one group of two nodes, plain or fused (the passes that
merge kernels after fusion use it).

Groups of the same structure share one Task (`group_key`): the layers of a transformer fuse
into identical groups, whose members share their operators' Tasks
(`kiln.graph.OperatorDef.task`), so the Task is composed once, and what is derived from it by
identity (the templates that take it, its built kernel) is derived once for all of them.
"""
from __future__ import annotations

import math
from typing import Sequence

from kiln.graph import FlowGraph, Operator
from kiln.graph.operator import Recent
from kiln.ir import Compute, Expr, Load, Task, TensorInput, Var, rewrite, substitute
from kiln.ir.inline import float32_reads
from kiln.ir.expr import walk
from kiln.ir.size import size_key
from kiln.tensor import Tensor

GROUPS_KEPT = 1024
"""The most composed Tasks kept for groups of distinct structure (`group_key`); the least
recently used goes first (a group of its structure then composes its Task again)."""

# group_key -> (the members' tasks, held so that their ids stay their own; the composed Task)
_composed = Recent(lambda: GROUPS_KEPT)


class _NotFoldable(Exception):
    pass


def fold_anchor(out: Compute, anchor: Compute) -> Compute | None:
    """`out` with the injective computes it reads inlined and every read of `anchor` replaced
    by the anchor's value (its reduction), so that one compute holds the reduction and the
    epilogue around it, as a template's epilogue hook renders it. None unless the result
    reads the anchor at one index only (and no other reduction), and unless each element of
    `out` reads its own element of the anchor: where several would read the same one (a row
    statistic broadcast over its row: RMSNorm's mean of squares, a softmax's sum), folding
    would compute that reduction again for each of them, so the anchor stays a compute of its
    own, which the schedule computes once (see `kiln.schedule.rows`)."""
    found: dict[tuple, Expr] = {}
    found_plain: dict[tuple, Expr] = {}
    memo: dict[int, tuple] = {}
    anchor_reads: dict[tuple, tuple] = {}

    def folder(cache: dict, inner):
        def fold(e: Expr) -> Expr:
            if not (isinstance(e, Load) and isinstance(e.tensor, Compute)):
                return e
            t = e.tensor
            key = (id(t),) + tuple(i.key() for i in e.indices)
            if key not in cache:
                if t is not anchor and t.has_reduce:
                    raise _NotFoldable
                value = substitute(t.value, {id(a): i for a, i in zip(t.axes, e.indices)})
                if t is anchor:
                    anchor_reads[key] = e.indices
                cache[key] = value if t is anchor else inner(value)
            return cache[key]
        return fold

    fold = folder(found, lambda v: rewrite(v, fold, wide, memo))
    fold_plain = folder(found_plain, lambda v: rewrite(v, fold_plain))

    def inlined_value(load: Load) -> Expr | None:
        t = load.tensor
        if not isinstance(t, Compute) or (t.has_reduce and t is not anchor):
            return None
        return fold(Load(t, [rewrite(i, fold, wide, memo) for i in load.indices]))

    # Element-wise members chained in 16-bit floats compute in float32 (`kiln.ir.inline`), and
    # so does the anchor's value that they read: a bias added to a 16-bit matmul rounds once,
    # as cuBLAS's bias epilogue does.
    wide = float32_reads(inlined_value, lambda e: rewrite(e, fold_plain))

    try:
        value = rewrite(out.value, fold, wide, memo)
    except _NotFoldable:
        return None
    if len(anchor_reads) != 1 or not _one_to_one(out, anchor, next(iter(anchor_reads.values()))):
        return None
    return Compute(out.name, out.axes, value)


def _one_to_one(out: Compute, anchor: Compute, index: Sequence[Expr]) -> bool:
    """Whether `out` reads a different element of `anchor` at `index` for each of its own:
    as many elements, and every axis of `out` longer than 1 used by the index."""
    if math.prod(out.shape) != math.prod(anchor.shape):
        return False
    used = {id(v) for i in index for v in walk(i) if isinstance(v, Var)}
    return all(extent == 1 or id(axis) in used for axis, extent in zip(out.axes, out.shape))


def compose_task(name: str, nodes: Sequence[Operator], inputs: Sequence[Tensor],
                 outputs: Sequence[Tensor], anchor: Operator) -> Task:
    """One Task computing `outputs` of the member `nodes` (in order) from `inputs`.

    Where the group has one output and the anchor one output holding a reduction, the anchor
    is folded into that output (see `fold_anchor`; the output may be the anchor's own, read
    through views before it) and the task takes the anchor operator's name, so the anchor's
    templates may take it; otherwise it is named `name`."""
    nodes_of: dict[int, object] = {id(t): TensorInput(f"in{k}", t.shape, t.dtype)
                                   for k, t in enumerate(inputs)}
    for node in nodes:
        loads = {id(spec): nodes_of[id(t)] for spec, t in zip(node.task.inputs, node.inputs)}
        for tn in node.task.nodes():
            if isinstance(tn, Compute):
                axes = [Var(a.name, a.extent) for a in tn.axes]
                value = substitute(tn.value, {id(a): b for a, b in zip(tn.axes, axes)}, loads=loads)
                loads[id(tn)] = Compute(tn.name, axes, value)
        for out, spec in zip(node.outputs, node.task.outputs):
            nodes_of[id(out)] = loads[id(spec)]
    task_inputs = [nodes_of[id(t)] for t in inputs]
    task_outputs = [nodes_of[id(t)] for t in outputs]
    reduction = nodes_of[id(anchor.outputs[0])]
    if (len(task_outputs) == 1 and len(anchor.outputs) == 1 and isinstance(reduction, Compute)
            and reduction.has_reduce):
        if task_outputs[0] is reduction:      # views before the anchor only
            return Task(anchor.definition.name, task_inputs, task_outputs)
        folded = fold_anchor(task_outputs[0], reduction)
        if folded is not None:
            return Task(anchor.definition.name, task_inputs, [folded])
    return Task(name, task_inputs, task_outputs)


def group_key(nodes: Sequence[Operator], inputs: Sequence[Tensor], outputs: Sequence[Tensor],
              anchor: int) -> tuple:
    """What `compose_task` reads of a group, as a hashable key: each member's Task (by identity)
    and operator, where each of its inputs comes from (the group input at a position, or a
    member's output), the group inputs' shapes and dtypes, which member outputs the group
    returns and the anchor's position. Groups of equal keys compose equal Tasks."""
    source = {id(t): ("in", k) for k, t in enumerate(inputs)}
    for j, node in enumerate(nodes):
        source.update((id(t), (j, k)) for k, t in enumerate(node.outputs))
    members = tuple((id(n.task), n.definition.name, tuple(source[id(t)] for t in n.inputs)) for n in nodes)
    return (members, tuple((size_key(t.shape), t.dtype.name) for t in inputs),
            tuple(source[id(t)] for t in outputs), anchor)


def _group_task(nodes: list[Operator], inputs: Sequence[Tensor], outputs: Sequence[Tensor],
                anchor: int) -> Task:
    """The Task of the group (see `FusedOperator`), composed once for each `group_key`."""
    key = group_key(nodes, inputs, outputs, anchor)
    found = _composed.get(key)
    if found is None:
        anchor_node = nodes[anchor]
        task = compose_task(f"fused_{anchor_node.definition.name}", nodes, inputs, outputs, anchor_node)
        task.attrs.update(anchor_node.task.attrs)     # what the anchor's templates read
        task.attrs.update(anchor=anchor, anchor_operator=anchor_node.definition.name)
        found = ([n.task for n in nodes], task)
        _composed.put(key, found)
    return found[1]


class FusedOperator(Operator):
    """Operators `nodes` (in graph order) fused into one node with one Task.

    `inputs` are the tensors the group reads from outside, `outputs` the member tensors used
    outside it (in the given order); `anchor` is the index in `nodes` of the member the group
    is built around. `definition` is the anchor's: schedules dispatch on it. Groups of the same
    structure share their Task (see the module docs).
    """

    def __init__(self, nodes: Sequence[Operator], inputs: Sequence[Tensor],
                 outputs: Sequence[Tensor], anchor: int):
        nodes = list(nodes)
        anchor_node = nodes[anchor]
        self.fused_graph = FlowGraph(outputs, inputs, nodes)
        self.anchor = anchor
        self.definition = anchor_node.definition
        self.inputs = list(inputs)
        self.attrs = {"fused_graph": self.fused_graph, "anchor": anchor}
        self.device = anchor_node.device
        self.task = _group_task(nodes, inputs, outputs, anchor)
        self.outputs = [Tensor(t.shape, t.dtype, self.device, trace=(self, k)) for k, t in enumerate(outputs)]

    @property
    def name(self) -> str:
        return "Fused" + self.definition.display_name

    def with_inputs(self, inputs: Sequence[Tensor]) -> "FusedOperator":
        """The same group reading `inputs` (of the same shapes and types) instead."""
        fused = FusedOperator.__new__(FusedOperator)
        fused.__dict__.update(self.__dict__)
        fused.inputs = list(inputs)
        fused.outputs = [Tensor(t.shape, t.dtype, self.device, trace=(fused, k))
                         for k, t in enumerate(self.outputs)]
        return fused


def merged(first: Operator, second: Operator, readers: list[Tensor]) -> tuple[Operator, list]:
    """The group of `first`'s members and `second`'s (plain or fused nodes; `second` may read
    `first`'s values, inside the group), with the outputs of `first` among `readers` and all of
    `second`'s, and `first`'s anchor; and its output (None where dropped) for each output of
    `first`, then of `second`."""
    members, inner_inputs, inner_outputs, anchor = members_of(first)
    outer_inputs = list(first.inputs)
    inner = dict(zip(map(id, first.inputs), inner_inputs)) | dict(zip(map(id, first.outputs), inner_outputs))
    second_members, second_inputs, second_outputs, _ = members_of(second)
    swap: dict[int, Tensor] = {}
    for outer, placeholder in zip(second.inputs, second_inputs):
        if id(outer) not in inner:
            inner[id(outer)] = placeholder
            inner_inputs.append(placeholder)
            outer_inputs.append(outer)
        swap[id(placeholder)] = inner[id(outer)]
    for m in second_members:
        ins = [swap.get(id(t), t) for t in m.inputs]
        if any(a is not b for a, b in zip(ins, m.inputs)):
            new = Operator(m.definition, ins, m.attrs, m.task, m.device)
            swap.update(zip(map(id, m.outputs), new.outputs))
            m = new
        members.append(m)
    used = {id(t) for t in readers}
    kept = [k for k, t in enumerate(first.outputs) if id(t) in used]
    outputs = [inner_outputs[k] for k in kept] + [swap.get(id(t), t) for t in second_outputs]
    node = FusedOperator(members, inner_inputs, outputs, anchor).with_inputs(outer_inputs)
    position = dict(zip(kept, node.outputs))
    return node, [position.get(k) for k in range(len(first.outputs))] + node.outputs[len(kept):]


def members_of(node: Operator) -> tuple[list[Operator], list[Tensor], list[Tensor], int]:
    """A node's members, inner inputs, inner outputs and anchor: a fused group's, or the node
    as a group of one."""
    if isinstance(node, FusedOperator):
        g = node.fused_graph
        return list(g.nodes), list(g.inputs), list(g.outputs), node.anchor
    return [node], list(node.inputs), list(node.outputs), 0
