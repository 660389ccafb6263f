"""What of a dynamo graph Kiln compiles, and splitting it between Kiln and PyTorch.

`nodes_for_pytorch(gm, example_inputs)` interprets the graph symbolically on the example
inputs' shapes (nothing is built) and names each node Kiln cannot translate, with why: no
rule maps it, every rule declines its arguments (bicubic interpolation, training-mode dropout
or batch_norm), or it reads or makes a tensor of a dtype Kiln does not support (a complex graph
input, a complex value PyTorch computes). Past such a node the interpretation goes on with a
stand-in value made from dynamo's metadata. Kiln's parts take and return real tensors only, so
the complex values Kiln computes that would cross into PyTorch are computed there too.

`split(gm, for_pytorch, compile_part)` cuts the graph into runs of nodes: each run Kiln can
do is compiled by `compile_part(submodule)`, each other node runs alone in PyTorch.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx import GraphModule, Node
from torch.fx.node import map_aggregate
from torch.fx.passes.split_module import split_module

from kiln.dtypes import data_type
from kiln.frontend.torch.complex import ComplexTensor
from kiln.frontend.torch.interpreter import Interpreter, MappingError, Unrepresentable
from kiln.frontend.torch.sizes import reads_value
from kiln.tensor import from_torch, symbol


def _hint(value):
    """A concrete int for a SymInt of dynamo's metadata or example inputs (its size hint)."""
    if isinstance(value, torch.SymInt):
        hint = getattr(value.node, "hint", None)
        return int(hint) if hint is not None else Unrepresentable("a size without a hint")
    return value


def _supported(dtype: torch.dtype) -> bool:
    try:
        data_type(dtype)
        return True
    except TypeError:
        return False


def stand_in(example):
    """A Kiln value like dynamo's example value `example`: a symbolic tensor of its shape and
    dtype, or `Unrepresentable` where Kiln has no such dtype (or no example is known)."""
    def one(v):
        if isinstance(v, torch.Tensor):
            if not _supported(v.dtype):
                return Unrepresentable(f"a {str(v.dtype).replace('torch.', '')} tensor")
            shape = [_hint(d) for d in v.shape]
            if any(isinstance(d, Unrepresentable) for d in shape):
                return Unrepresentable("a tensor of unknown size")
            return symbol(shape, v.dtype, v.device)
        return _hint(v)
    if example is None:
        return Unrepresentable("a value dynamo recorded no example of")
    return map_aggregate(example, one)


def nodes_for_pytorch(gm: GraphModule, example_inputs, constants: set[str] = frozenset()
                      ) -> dict[Node, str]:
    """Each node of `gm` Kiln cannot compile on inputs like `example_inputs`, with the reason."""
    found: dict[Node, str] = {}

    def declined(node: Node, error: MappingError):
        found[node] = str(error)
        return stand_in(node.meta.get("example_value", node.meta.get("val")))

    inputs = []
    for node, value in zip(gm.graph.find_nodes(op="placeholder"), example_inputs):
        known = node.name in constants or reads_value(node)      # as `KilnFunction` traces it
        if (isinstance(value, torch.Tensor) and not isinstance(value, FakeTensor) and known
                and _supported(value.dtype)):
            inputs.append(from_torch(value))
        else:
            inputs.append(stand_in(value))
    values: dict[Node, object] = {}
    Interpreter(gm).run(inputs, on_node=values.__setitem__, on_error=declined)
    _complex_stays_inside(gm, found, values)
    return {node: found[node] for node in gm.graph.nodes if node in found}


def _complex(node: Node, values: dict) -> bool:
    found = []
    map_aggregate(values.get(node), lambda v: found.append(v) if isinstance(v, ComplexTensor) else v)
    meta = node.meta.get("example_value", node.meta.get("val"))
    map_aggregate(meta, lambda v: found.append(v) if isinstance(v, torch.Tensor) and v.is_complex() else v)
    return bool(found)


def _complex_stays_inside(gm: GraphModule, found: dict[Node, str], values: dict) -> None:
    """Kiln's parts take and give real tensors only: a node with a complex value that a node
    run in PyTorch (or the graph's output) reads runs in PyTorch too, and so does a node
    reading a complex value PyTorch makes, until no complex value crosses a border."""
    complex_nodes = {node for node in gm.graph.nodes if _complex(node, values)}
    changed = True
    while changed:
        changed = False
        for node in gm.graph.nodes:
            if node in found or node.op in ("placeholder", "output", "get_attr"):
                continue
            if node in complex_nodes and any(u.op == "output" or u in found for u in node.users):
                found[node] = "its complex value is read outside Kiln (Kiln's parts return real tensors)"
            elif any(i in found and i in complex_nodes for i in node.all_input_nodes):
                found[node] = "it reads a complex value computed in PyTorch (Kiln's parts take real tensors)"
            else:
                continue
            changed = True


def split(gm: GraphModule, for_pytorch: set[Node], compile_part: Callable) -> GraphModule:
    """`gm` cut into runs of nodes Kiln compiles (`compile_part(submodule)` each) and single
    nodes of `for_pytorch` left to PyTorch."""
    partition, compiled, current, previous = {}, {}, 0, None
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        ok = node not in for_pytorch
        if ok != previous or not ok:  # each node for PyTorch runs alone
            current += 1
        partition[node], compiled[current], previous = current, ok, ok
    parts = _split_module(gm, partition.__getitem__)
    for pid, ok in compiled.items():
        name = f"submod_{pid}"
        if ok and hasattr(parts, name):
            part = compile_part(getattr(parts, name))
            delattr(parts, name)
            setattr(parts, name, part)
    return parts


def _split_module(gm: GraphModule, part_of: Callable[[Node], int]) -> GraphModule:
    """torch's `split_module` of `gm` by `part_of`, blind to dynamo's example values.

    Seeing them, `split_module` makes every size symbol of a value passed between parts an
    input of the part that reads it, taken from the node that first has that symbol as its value:
    a KeyError where no node has (a size taken from a 0-dim tensor input's value), a cycle
    where that node reads the value from another part (the size of a data-dependent result
    made in PyTorch, read by a node of its own). Kiln's parts read their sizes from the
    tensors they are called with (`kiln.frontend.torch.sizes`) and need no such input. The
    example values travel under another key, which `split_module` copies with the rest of
    each node's metadata, and are put back."""
    modules = [gm]
    for node in gm.graph.nodes:
        if "example_value" in node.meta:
            node.meta[_HIDDEN] = node.meta.pop("example_value")
    try:
        parts = split_module(gm, None, part_of, keep_original_order=True)
        modules += [m for m in parts.modules() if isinstance(m, GraphModule)]
    finally:
        for module in modules:
            for node in module.graph.nodes:
                if _HIDDEN in node.meta:
                    node.meta["example_value"] = node.meta.pop(_HIDDEN)
    return parts


_HIDDEN = "kiln_example_value"
