"""Finding in-place changes that reach other tensors through views.

The fx interpreter gives each node a value of its own, so it cannot make a write through a
view (`y = x[0]; y.add_(1)`) reach the view's base, nor make a view taken before its base was
changed in place (`v = x.view(-1); x.mul_(2); return v`) see the change. `view_mutations(gm)`
lists the nodes of a graph where either happens; the backend runs such graphs in PyTorch.

Ops that may return a view or the tensor itself (`VIEW_METHODS`, `VIEW_FUNCTIONS`) are taken
as views whatever their arguments: a copy mistaken for a view only costs speed.
"""
from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule, Node

from kiln.frontend.torch.interpreter import mutates

VIEW_METHODS = frozenset({
    "view", "view_as", "reshape", "reshape_as", "transpose", "transpose_", "permute", "t", "T",
    "mT", "narrow", "select", "expand", "expand_as", "unsqueeze", "squeeze", "flatten",
    "unflatten", "as_strided", "diagonal", "unfold", "movedim", "moveaxis", "swapaxes",
    "swapdims", "split", "chunk", "unbind", "tensor_split", "split_with_sizes", "contiguous",
    "detach", "real", "imag", "view_as_real", "__getitem__", "to", "type", "type_as", "float",
    "double", "half", "bfloat16", "int", "long", "bool", "cpu", "cuda",
})
VIEW_FUNCTIONS = frozenset({
    operator.getitem, torch.transpose, torch.permute, torch.t, torch.narrow, torch.select,
    torch.reshape, torch.flatten, torch.unflatten, torch.unsqueeze, torch.squeeze, torch.split,
    torch.chunk, torch.unbind, torch.tensor_split, torch.diagonal, torch.movedim,
    torch.swapaxes, torch.swapdims, torch.as_strided, torch.detach, torch.view_as_real,
    torch.real, torch.imag,
})


def _is_view(node: Node) -> bool:
    if node.op == "call_method":
        return node.target in VIEW_METHODS
    return node.op == "call_function" and node.target in VIEW_FUNCTIONS


def _mutated(node: Node) -> Node | None:
    """The node whose tensor `node` changes in place, or None."""
    if node.args and isinstance(node.args[0], Node) and mutates(node):
        return node.args[0]
    return None


def _selects_fresh_result(node: Node, source: Node, viewed: dict) -> bool:
    """Whether `node` takes an element of a tuple of fresh tensors (`torch.max(x, 1)[0]`),
    as dynamo's metadata shows; not of a tuple of views (`x.split(2)[0]`)."""
    meta = source.meta.get("example_value", source.meta.get("val"))
    return (node.target is operator.getitem and isinstance(meta, (tuple, list))
            and not viewed.get(source, False))


def view_mutations(gm: GraphModule) -> list[str]:
    """Each place where `gm` changes a tensor in place while another node is a view of it
    (one line each); empty where the interpreter's value semantics are exact."""
    nodes = list(gm.graph.nodes)
    position = {n: k for k, n in enumerate(nodes)}
    root: dict[Node, Node] = {}          # the tensor a node is (or is a view of)
    viewed: dict[Node, bool] = {}        # whether a node is reached through a view
    found = []
    for node in nodes:
        target = _mutated(node)
        if target is not None:
            base = root.get(target, target)
            root[node], viewed[node] = base, viewed.get(target, False)
            if viewed.get(target, False):
                found.append(f"{node.format_node()} writes through a view of {base.name}")
                continue
            later = [v for v in nodes[:position[node]] if root.get(v) is base and viewed.get(v)
                     and any(position[u] > position[node] for u in v.users)]
            found += [f"{v.name}, a view of {base.name}, is read after {node.format_node()} "
                      f"changed it" for v in later]
        elif _is_view(node) and node.args and isinstance(node.args[0], Node):
            source = node.args[0]
            if _selects_fresh_result(node, source, viewed):
                continue
            root[node], viewed[node] = root.get(source, source), True
    return found
