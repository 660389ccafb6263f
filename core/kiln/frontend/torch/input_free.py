"""Values that depend on no input: recomputed by the backward instead of saved by the forward,
and built on the device that uses them.

A value a training graph computes from nothing but constants (a causal mask built from `arange`
and comparisons, position ids) is a constant to Kiln: it folds at compile time. AOTAutograd's
partitioner saves such a value for the backward when it cannot recompute every op on its path
(`index`, `cumsum`), so the backward would get it as an input, a tensor held from the forward
to the backward, unknown to the backward's compile. `recompute_input_free` moves the value's
computation into the backward graph: there it folds as well (and a pass may read it: a mask
equal to the causal one becomes the causal flag), and the forward saves one value less.

Kiln compiles a graph for one device. A value built from nothing on the CPU and copied to a GPU
inside the graph (numpy's random numbers as dynamo traces them, HuBERT's SpecAugment mask) is
not mapped where it stands: `build_where_used` builds it on the GPU instead, which gives the same
values (Kiln's generator draws the same numbers on every device).
"""
from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from kiln.frontend.torch.saved_values import saved_boundary, stop_saving


def _deterministic(node: Node) -> bool:
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded not in target.tags


def _input_free(graph: torch.fx.Graph, random: bool = False) -> set[Node]:
    """The call nodes whose value depends on no placeholder: each reads only such nodes and
    (unless `random`) draws no random numbers."""
    free: set[Node] = set()
    for node in graph.nodes:
        if (node.op == "call_function" and (random or _deterministic(node))
                and all(a in free for a in node.all_input_nodes)):
            free.add(node)
    return free


def recompute_input_free(forward: GraphModule, backward: GraphModule, num_fwd_outputs: int
                         ) -> tuple[GraphModule, GraphModule]:
    """`forward` and `backward` (as AOTAutograd's partitioner returns them: the forward's outputs
    from `num_fwd_outputs` on are the saved values, which the backward's leading placeholders
    take in order) with each saved tensor that depends on no input of the forward computed in
    the backward instead. Both graphs are changed in place and returned."""
    _, outputs, placeholders = saved_boundary(forward, backward, num_fwd_outputs)
    saved = outputs[num_fwd_outputs:]
    free = _input_free(forward.graph)
    moved = [(value, ph) for value, ph in zip(saved, placeholders)
             if value in free and isinstance(value.meta.get("val"), torch.Tensor) and value.name == ph.name]
    if not moved:
        return forward, backward
    needed = set().union(*({value} | _ancestors(value) for value, _ in moved))
    copies: dict[Node, Node] = {}
    first = next(n for n in backward.graph.nodes if n.op != "placeholder")
    with backward.graph.inserting_before(first):
        for node in forward.graph.nodes:
            if node in needed:
                copies[node] = backward.graph.node_copy(node, lambda n: copies[n])
    for value, ph in moved:
        ph.replace_all_uses_with(copies[value])
        backward.graph.erase_node(ph)
    return stop_saving(forward, backward, num_fwd_outputs, {v for v, _ in moved})


def build_where_used(gm: GraphModule) -> None:
    """Build on a GPU every value that depends on no input of `gm` and that only that GPU's
    nodes read (a copy to the GPU): the device arguments of the nodes it is built from change,
    and their example values move (in place). A value also read on its own device stays."""
    free = _input_free(gm.graph, random=True)
    for node in gm.graph.nodes:
        device = _device(node)
        for value in node.all_input_nodes:
            if not (value in free and device is not None and device.type != "cpu"
                    and _device(value) not in (None, device)):
                continue
            built = {value} | _ancestors(value)
            if all(u in built or (u.op != "output" and _device(u) == device) for n in built for u in n.users):
                for n in built:
                    _move(n, device)
    gm.recompile()


def _move(node: Node, device: torch.device) -> None:
    if "device" in node.kwargs:
        node.kwargs = {**node.kwargs, "device": device}
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor) and val.device != device:
        with val.fake_mode:
            node.meta["val"] = torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device=device)


def _device(node: Node) -> torch.device | None:
    val = node.meta.get("val")
    return val.device if isinstance(val, torch.Tensor) else None


def _ancestors(node: Node) -> set[Node]:
    seen: set[Node] = set()
    stack = list(node.all_input_nodes)
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen
