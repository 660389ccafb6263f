"""In-place updates of graph inputs: a KV cache written at a position, without rewriting it whole.

A graph that changes an input in place (transformers' StaticCache: `keys.index_copy_(2,
cache_position, new_keys)`) is traced as a pure graph whose output, the input's new value, is
written back into the caller's tensor after the graph (`kiln.frontend.torch.backend`). Done as
is, each call computes the whole new cache and copies it back: twice the cache's bytes written,
for a few new rows.

`UpdateInPlace(written)` (run after the optimization pipeline, on the graph that is compiled;
`written` maps graph output positions to the positions of the inputs they are written back
to) finds each written-back output computed by an operator declaring the trait `updates`
(`kiln.graph.Traits`: the operator's result is its argument with some elements replaced) on
that very input, alone or as the anchor of a fused group, and replaces it by the two nodes of
`kiln.graph.in_place`: UpdateRows (the new elements and their offsets; in a fused group it
takes the updating member's place, so what computes the sources stays fused with it) and
StoreRows (the input with those elements stored), which the compiled graph runs on the input's
own buffer (`kiln.graph.compile`): readers of the new value read the input's memory, and the
output written back is the input itself, so no copy is made (`CompiledRun` skips it; a
CUDA graph captures none). An output that an element-wise kernel computes from the input
itself (a counter's `add_(1)`) is written into the input's buffer by that kernel instead
(`kiln.passes.in_place_elements`). Then the UpdateRows groups of one step (a layer's keys and values)
are made one kernel where the later reads nothing computed between them, and StoreRows nodes
that follow each other one launch. The torch backend then folds StoreRows nodes into the
kernels computing their rows where that is safe (`kiln.passes.row_stores`: no launch of their
own), after merging independent kernels on a GPU.

Correctness rules:
- StoreRows is placed right before the first node that reads the new value; a node after it
  that reads the input (its old value) or a view of it (a node the compiled graph runs on the
  input's memory: `kiln.graph.compile.is_view`), or a graph output that is the input
  itself, keeps the update out of place (the graph is left as it was for that input);
- only the input itself is updated so: an update of a value computed from it (a second update
  of the same input in one graph, an update through a view) stays out of place;
- sizes must be fixed (a graph traced with symbolic sizes keeps the out-of-place update).

An input the caller passes non-contiguous is made contiguous for the run (as every input is):
the store goes into that copy and the write-back copies it into the caller's tensor, as
before. Disable the pass as any other: `PassContext(disabled_passes={"update_in_place"})`.
"""
from __future__ import annotations

from kiln.graph import FlowGraph, Operator
from kiln.graph.compile import is_view
from kiln.graph.in_place import ROWS, is_store, store_rows, update_rows
from kiln.passes.edit import merging, reapply
from kiln.passes.fused import FusedOperator, merged
from kiln.passes.in_place_elements import elements_in_place
from kiln.passes.graph_pass import GraphPass
from kiln.tensor import Tensor


class UpdateInPlace(GraphPass):
    """Updates written-back inputs in place (see the module's docstring). `written` maps the
    position of each graph output written back to the position of its input; `in_place` lists,
    after a run, the output positions now computed in place."""

    name = "update_in_place"
    opt_level = 1

    def __init__(self, written: dict[int, int]):
        self.written = dict(written)
        self.in_place: list[int] = []

    def transform(self, graph: FlowGraph, ctx) -> FlowGraph:
        self.in_place = []
        for out, position in self.written.items():
            updated = _in_place(graph, out, graph.inputs[position])
            if updated is None:
                updated = elements_in_place(graph, out, graph.inputs[position], ctx.session)
            if updated is not None:
                graph = updated
                self.in_place.append(out)
        return _stores_merged(_row_groups_merged(graph))


def _row_groups_merged(graph: FlowGraph) -> FlowGraph:
    """`graph` with each UpdateRows node or group made one with the last before it where it
    reads nothing computed between the two and neither reduces (the rows of a layer's keys
    and values, the keys' rotated by the group that computes the values' rows): one kernel."""
    def place(nodes, n, readers):
        last = next((k for k in reversed(range(len(nodes))) if nodes[k].definition is ROWS), None)
        if (n.definition is not ROWS or last is None or not n.task.is_injective
                or not nodes[last].task.is_injective or not _reads_before(n, nodes[last], nodes[:last])):
            nodes.append(n)
            return {}
        first = nodes[last]
        between = [t for m in nodes[last + 1:] for t in m.inputs]
        nodes[last], outputs = merged(first, n, between + readers())
        return {id(old): new for old, new in zip((*first.outputs, *n.outputs), outputs) if new is not None}
    return merging(graph, place)


def _reads_before(node: Operator, group: Operator, before: list[Operator]) -> bool:
    """Whether each input of `node` is an output of `group` or there before it (a graph input,
    a constant or an output of `before`)."""
    ready = {id(t) for m in (group, *before) for t in m.outputs}
    return all(t.trace is None or id(t) in ready for t in node.inputs)


def _stores_merged(graph: FlowGraph) -> FlowGraph:
    """`graph` with each run of consecutive StoreRows nodes made one (one launch stores a
    step's updates: a layer's K and V caches)."""
    def place(nodes, n, readers):
        if not (is_store(n) and nodes and is_store(nodes[-1])):
            nodes.append(n)
            return {}
        previous = nodes.pop()
        stored = store_rows(*(_parts(previous, k) + _parts(n, k) for k in range(3)))
        nodes.append(stored[0].trace[0])
        return dict(zip(map(id, previous.outputs + n.outputs), stored))
    return merging(graph, place)


def _parts(store: Operator, k: int) -> list[Tensor]:
    """The stored buffers (k=0), the rows (1) or the offsets (2) of a StoreRows node."""
    count = len(store.outputs)
    return store.inputs[k * count:(k + 1) * count]


def _updating_member(node: Operator, value: Tensor, target: Tensor):
    """(member, rows node, the member's tensor for `value`) where `value`, an output of `node`,
    is an update of `target` by an operator declaring `updates`: `node` itself, or the anchor
    of the fused group `node` whose result nothing else in the group reads; else None."""
    k = next(i for i, t in enumerate(node.outputs) if t is value)
    if isinstance(node, FusedOperator):
        inner = node.fused_graph.outputs[k]
        member = inner.trace[0] if inner.trace is not None else None
        if member is None or member is not node.fused_graph.nodes[node.anchor]:
            return None
        if any(inner is t for m in node.fused_graph.nodes for t in m.inputs):
            return None
        found = update_rows(member)
        if found is None:
            return None
        rows, position = found
        updated = member.inputs[position]
        outer = next((j for j, t in enumerate(node.fused_graph.inputs) if t is updated), None)
        if outer is None or node.inputs[outer] is not target:
            return None
        return member, rows, inner
    found = update_rows(node)
    if found is None or node.inputs[found[1]] is not target:
        return None
    return node, found[0], value


def _in_place(graph: FlowGraph, out: int, target: Tensor) -> FlowGraph | None:
    """`graph` with its output `out`, an update of the input `target`, computed in place; None
    where that is not possible or not safe."""
    value = graph.outputs[out]
    if value.trace is None or any(t is target for t in graph.outputs):
        return None
    node = value.trace[0]
    found = _updating_member(node, value, target)
    if found is None:
        return None
    member, rows_node, inner = found
    if node is member:
        replacement, (rows, where) = rows_node, rows_node.outputs
        mapping = {}
    else:
        members = [rows_node if m is member else m for m in node.fused_graph.nodes]
        kept = [t for t in node.fused_graph.outputs if t is not inner]
        fused = FusedOperator(members, node.fused_graph.inputs, kept + rows_node.outputs, node.anchor)
        replacement = fused.with_inputs(node.inputs)
        *others, rows, where = replacement.outputs
        mapping = {id(old): new for old, new in zip((t for t in node.outputs if t is not value), others)}
    store = store_rows([target], [rows], [where])
    mapping[id(value)] = store
    nodes: list[Operator] = []
    placed = False
    old = {id(target)}      # the input's old value, and views of it (which share its memory)
    for n in graph.nodes:
        if n is node:
            nodes.append(replacement)
            continue
        inputs = [mapping.get(id(t), t) for t in n.inputs]
        if not placed and any(t is store for t in inputs):
            nodes.append(store.trace[0])
            placed = True
        if any(id(t) in old for t in inputs):
            if placed:
                return None         # reads the input's old value after the store
            if is_view(n, graph):
                old.update(id(t) for t in n.outputs)
        if all(a is b for a, b in zip(inputs, n.inputs)):
            nodes.append(n)
            continue
        outs = reapply(n, inputs)
        nodes.append(outs[0].trace[0])
        mapping.update(zip(map(id, n.outputs), outs))
    if not placed:
        nodes.append(store.trace[0])
    return FlowGraph([mapping.get(id(t), t) for t in graph.outputs], graph.inputs, nodes)
