"""Narrowing casts of parameters recomputed by the backward instead of saved by the forward.

Under autocast, a linear layer's float32 weight is cast to bfloat16 in the forward, and the
backward reads the cast again (the input's gradient is the output's gradient times the weight).
AOTAutograd's min-cut partitioner saves the cast, 2 bytes a weight, as it weighs a parameter's
4 bytes against it; but a parameter is held from step to step anyway, and the backward's
captures read it in place (`kiln.runtime.cuda_graph`: memory that stays put), so saving the
parameter costs nothing and the cast is a short kernel. `recompute_parameter_casts` makes the
forward save the parameter and the backward cast it: ViT-B/16 holds its 172 MB of bfloat16
weights no more between the two graphs.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch.fx import GraphModule, Node

from kiln.frontend.torch.saved_values import saved_boundary

_CASTS = (torch.ops.aten._to_copy.default, torch.ops.prims.convert_element_type.default)


def _narrowing_cast_of(value: Node, parameters: set[Node]) -> Node | None:
    """The parameter `value` casts to a narrower dtype on the same device, or None."""
    if value.op != "call_function" or value.target not in _CASTS or not value.args or value.args[0] not in parameters:
        return None
    if set(value.kwargs) - {"dtype"} or len(value.args) > (2 if value.target is _CASTS[1] else 1):
        return None
    source, cast = value.args[0].meta.get("val"), value.meta.get("val")
    if not (isinstance(source, torch.Tensor) and isinstance(cast, torch.Tensor)):
        return None
    narrower = cast.dtype.itemsize < source.dtype.itemsize and cast.device == source.device
    return value.args[0] if narrower and cast.shape == source.shape else None


def recompute_parameter_casts(forward: GraphModule, backward: GraphModule, num_fwd_outputs: int,
                              parameters: Sequence[int]) -> tuple[GraphModule, GraphModule]:
    """`forward` and `backward` (as AOTAutograd's partitioner returns them: the forward's outputs
    from `num_fwd_outputs` on are the saved values, which the backward's leading placeholders
    take in order) with each saved narrowing cast of a parameter (a forward input at a position
    of `parameters`) replaced by the parameter, which the backward casts. Both graphs are changed
    in place and returned."""
    inputs = list(forward.graph.find_nodes(op="placeholder"))
    params = {inputs[k] for k in parameters if k < len(inputs)}
    output, outputs, placeholders = saved_boundary(forward, backward, num_fwd_outputs)
    saved = outputs[num_fwd_outputs:]
    changed = False
    for k, (value, ph) in enumerate(zip(saved, placeholders)):
        parameter = _narrowing_cast_of(value, params)
        if parameter is None or value.name != ph.name:
            continue
        outputs[num_fwd_outputs + k] = parameter
        users = list(ph.users)
        with backward.graph.inserting_after(ph):
            cast = backward.graph.call_function(value.target, (ph, *value.args[1:]), dict(value.kwargs))
        cast.meta["val"] = value.meta["val"]
        for user in users:
            user.replace_input_with(ph, cast)
        ph.meta["val"] = parameter.meta["val"]
        changed = True
    if changed:
        output.args = (tuple(outputs),)
        forward.graph.eliminate_dead_code()
        forward.recompile()
        backward.recompile()
    return forward, backward
