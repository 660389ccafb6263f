"""Sibling linears as one: linear layers that read the same input with constant weights
(attention's query, key and value projections; a gated MLP's gate and up projections) become
one `linear` over the concatenated weights, its output `split` back along the last dim.

One wider GEMM fills the GPU where three narrow ones each filled part of it, and reads its
input once. The concatenated weights are new constants (folded at optimize time), so the
merged layers' weights are held twice: disable the pass by name (`merge_sibling_linears`) to
save that memory.
"""
from __future__ import annotations

from kiln.passes.edit import rebuild
from kiln.passes.graph_pass import GraphPass
from kiln.passes.provided import provided


def _key(node):
    """What siblings share: input, weight dtype and in_features, and whether a bias is added.
    None for a node that is no linear with constant weights."""
    if node.definition.name != "linear" or len(node.inputs) not in (2, 3):
        return None
    x, w, *b = node.inputs
    if any(t.is_symbolic for t in (w, *b)) or w.ndim != 2:
        return None
    return id(x), w.dtype, w.shape[1], tuple(t.dtype for t in b), node.outputs[0].dtype


class MergeSiblingLinears(GraphPass):
    """Replace each group of two or more linears sharing an input (and weight dtype, bias or
    none) by one linear and a split of its output."""

    name = "merge_sibling_linears"
    opt_level = 1
    stage = "simplify"      # before constant folding, which computes the concatenated weights

    def transform(self, graph, ctx):
        linear, concat, split = provided("linear"), provided("concat"), provided("split")
        if None in (linear, concat, split):
            return graph
        groups: dict[tuple, list] = {}
        for node in graph.nodes:
            key = _key(node)
            if key is not None:
                groups.setdefault(key, []).append(node)
        siblings = {id(n): group for group in groups.values() if len(group) > 1 for n in group}
        if not siblings:
            return graph
        pieces: dict[int, object] = {}

        def merge(node, inputs):
            group = siblings.get(id(node))
            if group is None:
                return None
            if id(node) not in pieces:      # the group's first member: build the merged linear
                weights = concat([n.inputs[1] for n in group], 0)
                bias = [concat([n.inputs[2] for n in group], 0)] if len(inputs) == 3 else []
                merged = linear(inputs[0], weights, *bias)
                outs = split(merged, [n.inputs[1].shape[0] for n in group], -1)
                pieces.update({id(n): out for n, out in zip(group, outs)})
            return [pieces[id(node)]]

        return rebuild(graph, merge)
