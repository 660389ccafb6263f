"""In-place updates stored by the kernel computing their rows: one launch, not two.

`kiln.passes.in_place` turns an update of a graph input (a KV cache written at the decoding
position) into an UpdateRows node (the new rows and their offsets, fused with what computes
them) and a StoreRows node (their store into the input's buffer), a launch of its own. On a
GPU a launch costs microseconds, more than such a store's memory time.

`StoreRowsInKernels` (run by the torch backend on the graph it compiles, last: after the
in-place updates and, on GPU graphs, the horizontal merge) folds each part of a StoreRows node
into the node computing that part's rows and offsets (`kiln.graph.in_place.storing_rows`): its
kernel copies each new row element to its offset in the input's buffer as it writes the rows
(`kiln.ir.row_stores`), and readers of the updated input read that node's new output, the
input's own buffer. A StoreRows node whose every part folds goes; the others keep the parts
that do not.

A part folds where:
- its rows and offsets are an UpdateRows member's two outputs, of a node (plain or fused)
  whose task is injective, and the UpdateRows task's offsets are distinct
  (`kiln.graph.in_place.DISTINCT_OFFSETS`: which of two equal offsets' rows a GPU would store
  last is not fixed, so those keep the StoreRows node, which stores the later one on the CPU);
- neither that node's kernel nor any node between it and the StoreRows node reads the input or
  a view of it (a node the compiled graph runs on the input's memory: `kiln.graph.compile.
  is_view`): the store moves up to the rows' kernel, and those would read the new rows where
  they read the old value. (Nothing after the StoreRows node reads the old value:
  `kiln.passes.in_place` keeps such updates out of place.)

Disable the pass as any other: `PassContext(disabled_passes={"store_rows_in_kernels"})`.
"""
from __future__ import annotations

from kiln.graph import FlowGraph, Operator
from kiln.graph.compile import is_view
from kiln.graph.in_place import DISTINCT_OFFSETS, ROWS, is_store, store_rows, storing_rows
from kiln.ir import Compute, Load
from kiln.ir.expr import walk
from kiln.passes.edit import merging, reapply
from kiln.passes.fused import FusedOperator
from kiln.passes.graph_pass import GraphPass
from kiln.tensor import Tensor


class StoreRowsInKernels(GraphPass):
    """Folds StoreRows nodes into the kernels computing their rows (see the module's
    docstring)."""

    name = "store_rows_in_kernels"
    opt_level = 1

    def transform(self, graph: FlowGraph, ctx) -> FlowGraph:
        def place(nodes, n, readers):
            if not is_store(n):
                nodes.append(n)
                return {}
            return _folded(graph, nodes, n)
        return merging(graph, place)


def _folded(graph: FlowGraph, nodes: list[Operator], store: Operator) -> dict[int, Tensor]:
    """Place `store` (a StoreRows node) after `nodes` with its parts folded where they may be:
    the replacements made (old tensor id -> new tensor)."""
    count = len(store.outputs)
    xs, rows, offsets = (store.inputs[k * count:(k + 1) * count] for k in range(3))
    moved: dict[int, Tensor] = {}       # the outputs of the nodes given row stores, to theirs

    def current(t: Tensor) -> Tensor:
        while id(t) in moved:
            t = moved[id(t)]
        return t
    kept: list[int] = []
    for k in range(count):
        r, w = current(rows[k]), current(offsets[k])
        at = next((i for i, m in enumerate(nodes) if r.trace is not None and m is r.trace[0]), None)
        if at is None or not _foldable(graph, nodes, at, xs[k], r, w):
            kept.append(k)
            continue
        node = nodes[at]
        nodes[at] = storing_rows(node, xs[k], r.trace[1], w.trace[1])
        moved.update(zip(map(id, node.outputs), nodes[at].outputs))
        moved[id(store.outputs[k])] = nodes[at].outputs[-1]
        for i in range(at + 1, len(nodes)):     # the nodes placed since read the new node's outputs
            inputs = [current(t) for t in nodes[i].inputs]
            if any(a is not b for a, b in zip(inputs, nodes[i].inputs)):
                outs = reapply(nodes[i], inputs)
                moved.update(zip(map(id, nodes[i].outputs), outs))
                nodes[i] = outs[0].trace[0]
    if len(kept) == count:
        nodes.append(store)
    elif kept:
        stored = store_rows([xs[k] for k in kept], [current(rows[k]) for k in kept], [current(offsets[k]) for k in kept])
        rest = (stored[0] if isinstance(stored, tuple) else stored).trace[0]
        nodes.append(rest)
        moved.update((id(store.outputs[k]), t) for k, t in zip(kept, rest.outputs))
    return moved


def _foldable(graph: FlowGraph, nodes: list[Operator], at: int, x: Tensor, rows: Tensor, offsets: Tensor) -> bool:
    """Whether `nodes[at]`, computing `rows` and `offsets` (an update of the graph input `x`),
    may store them into `x` itself (see the module's docstring)."""
    node = nodes[at]
    if offsets.trace is None or offsets.trace[0] is not node or is_store(node) or not node.task.is_injective:
        return False
    (member, k), (other, j) = _member(node, rows.trace[1]), _member(node, offsets.trace[1])
    if member is None or member is not other or (k, j) != (0, 1) or member.definition is not ROWS:
        return False
    if member.task.attrs.get(DISTINCT_OFFSETS) is not True:
        return False
    old = {id(x)}       # the input's old value, and views of it (which share its memory)
    for m in nodes[:at]:
        if is_view(m, graph) and any(id(t) in old for t in m.inputs):
            old.update(id(t) for t in m.outputs)
    loaded = {id(e.tensor) for c in node.task.nodes() if isinstance(c, Compute)
              for e in walk(c.value) if isinstance(e, Load)}
    if any(id(t) in old and id(spec) in loaded for t, spec in zip(node.inputs, node.task.inputs)):
        return False
    return not any(id(t) in old for m in nodes[at + 1:] for t in m.inputs)


def _member(node: Operator, k: int) -> tuple[Operator | None, int | None]:
    """The member of `node` computing its output `k`, and that output's position among the
    member's: `node` itself for a plain node."""
    if not isinstance(node, FusedOperator):
        return node, k
    inner = node.fused_graph.outputs[k]
    return inner.trace if inner.trace is not None else (None, None)
