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

import torch

from kiln.ir.size import SymSize, value_at


def bound(value, values: dict[str, int] | None):
    """`value` (a plan, or anything a plan holds) with every SymSize in it an int: its value at
    `values`, or in its own trace where `values` is None. Containers and data classes holding
    none come back as they are."""
    if isinstance(value, SymSize):
        return int.__int__(value) if values is None else value_at(value, values)
    if isinstance(value, (str, bytes, int, float, bool, torch.Tensor, type(None), torch.dtype, torch.device)):
        return value
    if isinstance(value, (tuple, list)):
        items = [bound(v, values) for v in value]
        if all(a is b for a, b in zip(items, value)):
            return value
        return type(value)(items) if type(value) in (tuple, list) else type(value)(*items)
    if isinstance(value, dict):
        items = {k: bound(v, values) for k, v in value.items()}
        return value if all(items[k] is v for k, v in value.items()) else items
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changed = {f.name: new for f in dataclasses.fields(value) if f.init
                   for new in [bound(getattr(value, f.name), values)] if new is not getattr(value, f.name)}
        return dataclasses.replace(value, **changed) if changed else value
    return value


def binds_elsewhere(plan) -> bool:
    """Whether `plan` may be bound to sizes other than its trace's: none of its constants has a
    symbolic size."""
    return not any(isinstance(d, SymSize) for slot in plan.constants for d in plan.buffers[slot].shape)
