"""Finding in-place changes that reach other tensors through views or shared memory.

The fx interpreter gives each node a value of its own, so it cannot make a write through a
view (`y = x[0]; y.add_(1)`) reach the view's base, nor make a view taken before its base was
changed in place (`v = x.view(-1); x.mul_(2); return v`) see the change. `view_mutations(gm)`
lists the nodes of a graph where either happens; the backend compiles such graphs through
AOTAutograd, whose functionalization rewrites them into pure operations.

For the same reason a compiled graph cannot make a write to one input reach another input
that shares its memory (`f(a, a[0])` where f changes `a` in place): `shared_memory(args, ...)`
finds such inputs at call time, and the backend runs those calls in PyTorch.

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


def storage_address(t: torch.Tensor) -> int:
    """The address of `t`'s storage: for tensors with elements, equal exactly when they share
    one."""
    return t.untyped_storage().data_ptr()


def storages(args, positions: list[int]) -> dict[int, list[int]]:
    """The positions `positions` of the tensors `args` by storage address."""
    found: dict[int, list[int]] = {}
    for k in positions:
        found.setdefault(storage_address(args[k]), []).append(k)
    return found


def _byte_range(t: torch.Tensor) -> tuple[int, int]:
    """The bytes [first, end) of its storage that `t`'s elements lie in (and the gaps between)."""
    first = t.storage_offset()
    last = first + sum((n - 1) * stride for n, stride in zip(t.shape, t.stride()))
    return first * t.element_size(), (last + 1) * t.element_size()


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether tensors on one storage may share bytes (by extent: interleaved slices such as
    `x[::2]` and `x[1::2]` count as overlapping)."""
    if a.numel() == 0 or b.numel() == 0:
        return False
    (a_first, a_end), (b_first, b_end) = _byte_range(a), _byte_range(b)
    return a_first < b_end and b_first < a_end


def shared_memory(args, written: list[int], others: list[int],
                  constants: dict[int, list[int]]) -> list[tuple[int, int]]:
    """The pairs of positions (w, k) where `args[w]`, an input the graph changes in place, may
    share memory with `args[k]`: another of `written`, one of `others`, or a constant input
    (`constants`: their `storages`, found once, since constants keep their memory).

    Storage addresses are compared first: where every tensor has a storage of its own, a call
    costs one address per written and per other input (a few microseconds)."""
    by_storage = storages(args, written)
    pairs = []
    for k in others:
        if isinstance(args[k], torch.Tensor):
            same = by_storage.get(storage_address(args[k]))
            if same:
                pairs += [(w, k) for w in same]
    if len(by_storage) < len(written) or not by_storage.keys().isdisjoint(constants):
        for storage, ws in by_storage.items():
            pairs += [(w, k) for i, w in enumerate(ws) for k in ws[i + 1:] + constants.get(storage, [])]
    return [(w, k) for w, k in pairs if _overlap(args[w], args[k])]
