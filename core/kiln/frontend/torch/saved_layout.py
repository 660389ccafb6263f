"""Values a training forward saves for its backward keep the memory order eager gives them.

A channels-last network's activations are channels-last in eager (their strides put the
channels innermost), and Kiln computes them so (`kiln.passes.layout`), but a graph's values
have no strides: a saved activation left the forward as an NCHW-ordered copy (a transposing
kernel each) and entered the backward to be transposed back. `saved_in_memory_order` makes
each saved 4-d value the forward computes (not one of its inputs: those pass as they are) whose
example is channels-last leave the forward permuted to its memory order (N, H, W, C) and enter
the backward permuted back: the two graphs' layout planning then
reads and writes those values where they lie, and the transposes cancel.
"""
from __future__ import annotations

import torch
from torch.fx import GraphModule

from kiln.frontend.torch.saved_values import saved_boundary

_TO_MEMORY = (0, 2, 3, 1)
_TO_LOGICAL = (0, 3, 1, 2)


def _channels_last(value) -> bool:
    return (isinstance(value, torch.Tensor) and value.dim() == 4 and value.numel() > 0
            and not value.is_contiguous() and value.is_contiguous(memory_format=torch.channels_last))


def saved_in_memory_order(forward: GraphModule, backward: GraphModule, num_fwd_outputs: int
                          ) -> tuple[GraphModule, GraphModule]:
    """`forward` and `backward` (as AOTAutograd's partitioner returns them: the forward's outputs
    from `num_fwd_outputs` on are the saved values, which the backward's leading placeholders
    take in order) with each saved channels-last 4-d tensor passed in (N, H, W, C) order. Both
    graphs are changed in place and returned."""
    output, outputs, placeholders = saved_boundary(forward, backward, num_fwd_outputs)
    saved = outputs[num_fwd_outputs:]
    changed = False
    for k, (value, ph) in enumerate(zip(saved, placeholders)):
        example = value.meta.get("val") if hasattr(value, "meta") else None
        if value.op != "call_function" or not _channels_last(example) or value.name != ph.name:
            continue
        with forward.graph.inserting_before(output):
            moved = forward.graph.call_function(torch.ops.aten.permute.default, (value, list(_TO_MEMORY)))
        moved.meta["val"] = example.permute(*_TO_MEMORY)
        outputs[num_fwd_outputs + k] = moved
        users = list(ph.users)
        with backward.graph.inserting_after(ph):
            back = backward.graph.call_function(torch.ops.aten.permute.default, (ph, list(_TO_LOGICAL)))
        back.meta["val"] = example
        for user in users:
            user.replace_input_with(ph, back)
        ph.meta["val"] = example.permute(*_TO_MEMORY)
        changed = True
    if changed:
        output.args = (tuple(outputs),)
        forward.recompile()
        backward.recompile()
    return forward, backward
