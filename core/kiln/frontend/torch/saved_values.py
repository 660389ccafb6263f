"""Where a partitioned training graph's saved values cross from the forward to the backward.

AOTAutograd's partitioner returns a forward whose outputs from `num_fwd_outputs` on are the
values saved for the backward, and a backward whose leading placeholders take them in order.
The passes that change what is saved (`input_free`, `parameter_casts`, `layout_copies`,
`saved_layout`) edit both ends through `saved_boundary`; those that save fewer values end with
`stop_saving`.
"""
from __future__ import annotations

from torch.fx import GraphModule, Node


def saved_boundary(forward: GraphModule, backward: GraphModule, num_fwd_outputs: int
                   ) -> tuple[Node, list[Node], list[Node]]:
    """The forward's output node, its outputs as a list (the saved values from `num_fwd_outputs`
    on) and the backward's placeholders that take the saved values, in order."""
    output = next(iter(forward.graph.find_nodes(op="output")))
    outputs = list(output.args[0])
    placeholders = list(backward.graph.find_nodes(op="placeholder"))[:len(outputs) - num_fwd_outputs]
    return output, outputs, placeholders


def stop_saving(forward: GraphModule, backward: GraphModule, num_fwd_outputs: int, gone: set[Node]
                ) -> tuple[GraphModule, GraphModule]:
    """`forward` without the saved values in `gone` among its outputs (whose placeholders the
    caller took out of `backward`), its dead code removed, and both graphs recompiled."""
    output, outputs, _ = saved_boundary(forward, backward, num_fwd_outputs)
    output.args = (tuple(outputs[:num_fwd_outputs]) + tuple(v for v in outputs[num_fwd_outputs:] if v not in gone),)
    forward.graph.eliminate_dead_code()
    forward.recompile()
    backward.recompile()
    return forward, backward
