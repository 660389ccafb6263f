"""A plan made at some symbolic sizes, bound to the sizes of a call.

A `kiln.runtime.plan.Plan` traced with symbolic sizes (`kiln.ir.size.SymSize`) holds, wherever
a value is a size, the SymSize itself: buffer shapes, a program's size arguments, launch grids,
temporaries, tensor maps. `bound(plan, values)` is the same plan with each of them evaluated
with the size variables at `values` (name -> int; None: their values in the trace): a plan of
plain ints, for any size where the decisions that made the plan hold (`kiln.ir.size_reads`).

A plan whose constants have symbolic shapes holds values computed at the traced sizes: it binds
only to those (`binds_elsewhere` says no).
"""
from __future__ import annotations

import dataclasses
import functools

import torch

from kiln.ir.size import SymSize, value_at


def bound(value, values: dict[str, int] | None, within: set[int] | None = None):
    """`value` (a plan, or anything a plan holds) with every SymSize in it an int: its value at
    `values`, or in its own trace where `values` is None. Containers and data classes holding
    none come back as they are; with `within` (`symbolic_parts`), only those whose ids it holds
    are looked into."""
    if isinstance(value, SymSize):
        return int.__int__(value) if values is None else value_at(value, values)
    if within is not None and id(value) not in within:
        return value
    if isinstance(value, _LEAVES):
        return value
    if isinstance(value, (tuple, list)):
        items = [bound(v, values, within) for v in value]
        if all(a is b for a, b in zip(items, value)):
            return value
        return type(value)(items) if type(value) in (tuple, list) else type(value)(*items)
    if isinstance(value, dict):
        items = {k: bound(v, values, within) for k, v in value.items()}
        return value if all(items[k] is v for k, v in value.items()) else items
    names = _fields(type(value))
    if names:
        changed = {name: new for name in names for old in [getattr(value, name)]
                   for new in [bound(old, values, within)] if new is not old}
        return dataclasses.replace(value, **changed) if changed else value
    return value


def symbolic_parts(value) -> set[int]:
    """The ids of the containers and data classes in `value` that hold a SymSize, `value`'s own
    included where it does: what `bound` needs to look into. The caller keeps `value` alive
    while it uses them."""
    found: set[int] = set()

    def visit(v) -> bool:
        if isinstance(v, SymSize):
            return True
        if isinstance(v, _LEAVES):
            return False
        if isinstance(v, (tuple, list)):
            parts = list(v)
        elif isinstance(v, dict):
            parts = list(v.values())
        else:
            parts = [getattr(v, name) for name in _fields(type(v))]
        holds = [visit(p) for p in parts]
        if any(holds):
            found.add(id(v))
        return any(holds)

    visit(value)
    return found


_LEAVES = (str, bytes, int, float, bool, torch.Tensor, type(None), torch.dtype, torch.device)


@functools.lru_cache(maxsize=None)
def _fields(kind: type) -> tuple[str, ...]:
    """The names of the fields `dataclasses.replace` takes of the data class `kind` (none for
    other classes)."""
    if not dataclasses.is_dataclass(kind):
        return ()
    return tuple(f.name for f in dataclasses.fields(kind) if f.init)


def binds_elsewhere(plan) -> bool:
    """Whether `plan` may be bound to sizes other than its trace's: none of its constants has a
    symbolic size."""
    return not any(isinstance(d, SymSize) for slot in plan.constants for d in plan.buffers[slot].shape)
