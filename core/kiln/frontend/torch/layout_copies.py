"""Saved values that are copies of other saved values in another layout, recomputed by the
backward instead of saved by the forward.

An attention layer's output is saved for the attention's backward, and its copy in the
output projection's layout (`permute(...).contiguous()` of the heads) is saved too, for that
projection's weight gradient: AOTAutograd's min-cut partitioner saves a value that a matmul of
the backward reads rather than recompute it. When the value is only data movement from another
saved value, the backward can make the copy again from what it holds anyway: one memory-bound
kernel in the backward instead of a second copy held from the forward to the backward (12
values of [32, 197, 768] bfloat16 for ViT-B/16 at batch 32, 116 MB). A saved view is left as
it is: it shares its base's memory.
"""
from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from kiln.frontend.torch.saved_values import saved_boundary, stop_saving

aten = torch.ops.aten

_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.permute.default,
          aten.transpose.int, aten.t.default, aten.expand.default, aten.squeeze.dim, aten.squeeze.dims,
          aten.squeeze.default, aten.unsqueeze.default, aten.alias.default, aten.slice.Tensor, aten.select.int}
_COPIES = {aten.clone.default}


def _layout_chain(value: Node, leaves: set[Node]) -> list[Node] | None:
    """The nodes (in the forward's order, `value` last) that make `value` from one of `leaves`
    by views and copies only, at least one copy among them; None where there are none."""
    chain: list[Node] = []
    node = value
    while node not in leaves:
        if node.op != "call_function" or node.target not in _VIEWS | _COPIES:
            return None
        if node.all_input_nodes != [node.args[0]]:
            return None       # one tensor input, and sizes that are numbers (no symbolic size)
        chain.append(node)
        node = node.args[0]
    if not any(n.target in _COPIES for n in chain):
        return None
    return chain[::-1]


def recompute_layout_copies(forward: GraphModule, backward: GraphModule, num_fwd_outputs: int
                            ) -> tuple[GraphModule, GraphModule]:
    """`forward` and `backward` (as AOTAutograd's partitioner returns them: the forward's outputs
    from `num_fwd_outputs` on are the saved values, which the backward's leading placeholders
    take in order) with each saved value that is a copy of another saved value in another layout
    recomputed by the backward, before its first use, from that value. Both graphs are changed
    in place and returned."""
    _, outputs, placeholders = saved_boundary(forward, backward, num_fwd_outputs)
    saved = outputs[num_fwd_outputs:]
    held = {value: ph for value, ph in zip(saved, placeholders) if value.name == ph.name and saved.count(value) == 1}
    sources: set[Node] = set()          # saved values another one is now made from: kept
    gone: set[Node] = set()
    for value, ph in list(held.items()):
        if value in sources or not ph.users:
            continue
        chain = _layout_chain(value, set(held) - gone - {value})
        if chain is None:
            continue
        source = chain[0].args[0]
        first_use = next(n for n in backward.graph.nodes if n in ph.users)
        copies = {source: held[source]}
        with backward.graph.inserting_before(first_use):
            for node in chain:
                copies[node] = backward.graph.node_copy(node, lambda n: copies[n])
        ph.replace_all_uses_with(copies[value])
        backward.graph.erase_node(ph)
        sources.add(source)
        gone.add(value)
    return stop_saving(forward, backward, num_fwd_outputs, gone) if gone else (forward, backward)
