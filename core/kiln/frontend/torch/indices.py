"""Graph inputs used only as indices into other tensors.

PyTorch indexes a CUDA tensor with CPU index tensors (`x[i]`, `x[i] = v`, `x.index_put((i,), v)`)
and copies them over itself. A graph on a GPU copies such an input to its device at each call,
as it does CPU scalars (`kiln.frontend.torch.backend`); an input with any other use stays where
it is (dynamo's tracing has already refused device mixes eager would refuse).
"""
from __future__ import annotations

import operator

import torch
from torch.fx import Node
from torch.fx.node import map_aggregate

aten = torch.ops.aten

# (the call's target, the position of its indices argument)
_INDEXING = {
    ("call_function", operator.getitem): 1,
    ("call_function", operator.setitem): 1,
    ("call_function", torch.index_put): 1,
    ("call_function", torch.index_put_): 1,
    ("call_method", "index_put"): 1,
    ("call_method", "index_put_"): 1,
    ("call_method", "__getitem__"): 1,
    ("call_method", "__setitem__"): 1,
    ("call_function", aten.index.Tensor): 1,
    ("call_function", aten.index_put.default): 1,
    ("call_function", aten.index_put_.default): 1,
}


def _mentions(value, node: Node) -> bool:
    found = []
    map_aggregate(value, lambda v: found.append(v is node))
    return any(found)


def used_only_as_index(placeholder: Node) -> bool:
    """Whether every use of `placeholder` is inside the indices argument of an indexing call
    (and at least one use exists)."""
    if not placeholder.users:
        return False
    for user in placeholder.users:
        position = _INDEXING.get((user.op, user.target))
        if position is None or len(user.args) <= position:
            return False
        others = [a for k, a in enumerate(user.args) if k != position] + list(user.kwargs.values())
        if not _mentions(user.args[position], placeholder) or _mentions(others, placeholder):
            return False
    return True
