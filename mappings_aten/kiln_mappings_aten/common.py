"""Helpers shared by the ATen rules."""
from __future__ import annotations

import torch

from kiln import ops
from kiln.frontend.torch import register_function

aten = torch.ops.aten


def same_signature(op: str, *targets):
    """Map ATen overloads whose arguments are those of `kiln.ops.<op>` (positional, and the
    keywords it knows) to it."""
    def rule(*args, **kwargs):
        return getattr(ops, op)(*args, **kwargs)
    rule.__name__ = rule.__qualname__ = op
    register_function(*targets)(rule)
    return rule


def identity(*targets):
    """Map ATen overloads that copy or alias their first argument: Kiln's values never alias,
    so the value itself stands for the copy."""
    def rule(x, *args, **kwargs):
        return x
    rule.__name__ = rule.__qualname__ = "identity"
    register_function(*targets)(rule)
    return rule


def all_dims(dim) -> list[int] | None:
    """ATen's reduction dims: None and [] both mean every dim."""
    return None if dim is None or (isinstance(dim, (list, tuple)) and not dim) else (
        [dim] if isinstance(dim, int) else list(dim))
