"""Dynamo's symbolic sizes (SymInts) as Kiln's (`kiln.ir.size.SymSize`).

When dynamo traces a graph with symbolic sizes (a second sequence length, `dynamic=True`,
`torch._dynamo.mark_dynamic`), its placeholders' metadata says which dimensions of the tensor
inputs, and which int inputs, change from call to call: symbols s0, s1, ... or expressions of
them. Each becomes a SymSize of its value in the call being compiled, so that the FlowGraph
traced for that call carries them, and kernels that take sizes as arguments are built once
for every size. Sizes dynamo specialized (0 and 1 always) stay ints.
"""
from __future__ import annotations

import functools
import operator

import torch
from torch.fx import GraphModule

from kiln.ir.size import SymSize

_COMBINE = {"Add": operator.add, "Mul": operator.mul}
_BINARY = {"FloorDiv": operator.floordiv, "PythonMod": operator.mod, "Mod": operator.mod}


def _meta(node):
    return node.meta.get("val", node.meta.get("example_value"))


def _symbol_name(size) -> str | None:
    expr = getattr(getattr(size, "node", None), "expr", None)
    return str(expr) if expr is not None and getattr(expr, "is_Symbol", False) else None


def symbolic_size(expr, values: dict[str, int]):
    """The SymSize (or int) of a sympy size expression over symbols of known `values` (by
    name), or None where it holds anything else."""
    if expr.is_Integer:
        return int(expr)
    if expr.is_Symbol:
        name = str(expr)
        return SymSize.named(name, values[name]) if name in values else None
    combine = _COMBINE.get(type(expr).__name__) or _BINARY.get(type(expr).__name__)
    if combine is None or (type(expr).__name__ in _BINARY and len(expr.args) != 2):
        return None
    parts = [symbolic_size(a, values) for a in expr.args]
    if any(p is None for p in parts):
        return None
    return functools.reduce(combine, parts)


def _size(meta, actual: int, values: dict[str, int]) -> int:
    """`actual` as a SymSize where dynamo's `meta` (an int or a SymInt) says it is symbolic."""
    expr = getattr(getattr(meta, "node", None), "expr", None)
    if expr is None:
        return actual
    found = symbolic_size(expr, values)
    return found if found is not None and int(found) == actual else actual


def input_sizes(gm: GraphModule, args) -> list:
    """For each placeholder of `gm` called with `args`: a tensor argument's shape and an int
    argument's value, with symbolic sizes as SymSizes; any other argument as it is."""
    metas = [_meta(n) for n in gm.graph.find_nodes(op="placeholder")]
    values: dict[str, int] = {}
    pairs = []
    for meta, arg in zip(metas, args):
        if isinstance(arg, torch.Tensor) and isinstance(meta, torch.Tensor) and meta.dim() == arg.dim():
            pairs.append((meta.shape, arg.shape))
        elif isinstance(arg, int) and isinstance(meta, torch.SymInt):
            pairs.append(((meta,), (arg,)))
        else:
            pairs.append(None)
            continue
        for size, actual in zip(*pairs[-1]):
            name = _symbol_name(size)
            if name is not None:
                values[name] = int(actual)
    out = []
    for pair, arg in zip(pairs, args):
        if pair is None:
            out.append(arg.shape if isinstance(arg, torch.Tensor) else arg)
            continue
        sizes = tuple(_size(m, int(a), values) for m, a in zip(*pair))
        out.append(sizes if isinstance(arg, torch.Tensor) else sizes[0])
    return out


def size_ranges(gm: GraphModule) -> dict[str, tuple[int, int | None]]:
    """The least and greatest value (None: unbounded) that dynamo's guards let each size
    variable of `gm`'s inputs take, by name: at other values dynamo traces another graph."""
    found = {}
    for meta in map(_meta, gm.graph.find_nodes(op="placeholder")):
        dims = meta.shape if isinstance(meta, torch.Tensor) else (meta,) if isinstance(meta, torch.SymInt) else ()
        for size in dims:
            name = _symbol_name(size)
            known = size.node.shape_env.var_to_range.get(size.node.expr) if name is not None else None
            if known is not None:
                found[name] = (_finite(known.lower), _finite(known.upper))
    return found


def _finite(bound) -> int | None:
    """A bound of dynamo's value ranges as an int, None where infinite (`int_oo`)."""
    return int(bound) if bound.is_Integer else None


def reads_value(placeholder) -> bool:
    """Whether a graph reads the value of its input `placeholder` as a number: through
    `.item()`, or where dynamo took a size from it while tracing (the input's example is a
    fake tensor whose `item_memo` holds that size: an operator's sizes given as 0-dim tensors)."""
    example = placeholder.meta.get("example_value")
    return (any(u.op == "call_method" and u.target == "item" for u in placeholder.users)
            or getattr(example, "item_memo", None) is not None)
