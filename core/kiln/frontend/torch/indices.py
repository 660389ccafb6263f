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

# the calls (op, target) whose second argument is the indices
_INDEXING = frozenset({
    ("call_function", operator.getitem), ("call_function", operator.setitem),
    ("call_function", torch.index_put), ("call_function", torch.index_put_),
    ("call_method", "index_put"), ("call_method", "index_put_"),
    ("call_method", "__getitem__"), ("call_method", "__setitem__"),
    ("call_function", aten.index.Tensor), ("call_function", aten.index_put.default),
    ("call_function", aten.index_put_.default),
})


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
        if (user.op, user.target) not in _INDEXING or len(user.args) < 2:
            return False
        others = [user.args[0], *user.args[2:], *user.kwargs.values()]
        if not _mentions(user.args[1], placeholder) or _mentions(others, placeholder):
            return False
    return True
