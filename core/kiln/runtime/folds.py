"""Folded tensors: how each tensor that a kernel computed at compile time was made.

A compile runs kernels on constants (constant folding: a weight transposed, batch norms folded
into a convolution's weight, sibling layers' weights concatenated). `record` notes each such run
as it happens: the kernel's program and device, and its inputs, each either another recorded
run's output or a tensor made otherwise (a parameter, a literal), held weakly.

The whole-graph cache then stores, instead of a folded constant's values, `fold_plan`'s `Plan`
of the kernel runs that made it from the compiled graph's arguments: a hit runs that plan on the
caller's parameters. A Llama-style model's concatenated projection weights so take no room in
its cache entry, and the values they were made from need no hash on a hit: what is computed from
the caller's own parameters is theirs.

`sources(t)` are the tensors made otherwise that `t` was computed from (those still alive): a
compile that reads a folded tensor's values (`kiln.tensor.recording_reads`) has read theirs.
"""
from __future__ import annotations

import itertools
import threading
import weakref
from dataclasses import dataclass
from typing import Iterator

import torch

from kiln.device import Device
from kiln.runtime.compiled_graph import Buffer
from kiln.runtime.plan import Plan


@dataclass(eq=False)
class _Run:
    """One kernel run at compile time: `inputs[k]` is `(run, index)` for another run's output, or
    a weak reference to a tensor no recorded run made."""
    order: int
    program: object
    device: Device
    inputs: list
    outputs: list[Buffer]


_made: dict[int, tuple[weakref.ref, _Run, int]] = {}    # id(tensor) -> (its reference, run, output index)
_lock = threading.RLock()      # reentrant: a reference's callback may run while it is held (a collection)
_order = itertools.count()


def _forget(key: int, ref: weakref.ref) -> None:
    with _lock:
        if _made.get(key, (None,))[0] is ref:
            del _made[key]


def _made_by(t: torch.Tensor) -> tuple[_Run, int] | None:
    found = _made.get(id(t))
    return found[1:] if found is not None and found[0]() is t else None


def record(program, device: Device, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> None:
    """Note that the kernel of `program` on `device` computed `outputs` from `inputs`."""
    with _lock:
        sources = [_made_by(t) or weakref.ref(t) for t in inputs]
        run = _Run(next(_order), program, device, sources,
                   [Buffer(tuple(o.shape), o.dtype, o.device) for o in outputs])
        for k, o in enumerate(outputs):
            ref = weakref.ref(o, lambda ref, key=id(o): _forget(key, ref))
            _made[id(o)] = (ref, run, k)


def _runs(found: tuple[_Run, int] | None) -> Iterator[_Run]:
    """The runs `found` (a run and output index) depends on, itself included, each once."""
    seen, stack = set(), [found[0]] if found else []
    while stack:
        run = stack.pop()
        if id(run) not in seen:
            seen.add(id(run))
            yield run
            stack.extend(source[0] for source in run.inputs if isinstance(source, tuple))


def sources(t: torch.Tensor) -> list[torch.Tensor]:
    """The tensors (alive) that no recorded run made which `t` was computed from; none for a
    tensor no recorded run made."""
    with _lock:
        runs = list(_runs(_made_by(t)))
    leaves = (source() for run in runs for source in run.inputs if not isinstance(source, tuple))
    return list({id(leaf): leaf for leaf in leaves if leaf is not None}.values())


@dataclass
class FoldPlan:
    """The kernel runs that compute some constants again: run `plan` on the arguments at
    `arguments` (positions of the compiled graph's arguments); its outputs are the constants of
    the slots `slots`."""
    plan: Plan
    arguments: list[int]
    slots: list[int]

    def computed(self, args, kernels=None) -> dict[int, torch.Tensor]:
        """The constants by slot, computed from `args` (the compiled graph's arguments) by
        `kernels` (`Plan.assemble`'s: the plan's own by default)."""
        outputs = self.plan.assemble(kernels).run([args[k] for k in self.arguments])
        return dict(zip(self.slots, outputs))


def fold_plan(constants: dict[int, torch.Tensor], arguments: dict[int, int]) -> FoldPlan | None:
    """The plan computing those of `constants` (by slot) that recorded runs made from the
    arguments (`arguments`: id of an argument tensor -> its position) and from tensors still
    alive (held by the plan as its constants); None where there are none. A folded tensor made
    from one that is gone is left out."""
    with _lock:
        wanted = {slot: _made_by(t) for slot, t in constants.items()}
        wanted = {slot: found for slot, found in wanted.items() if found is not None}
        runs = {id(run): run for found in wanted.values() for run in _runs(found)}
    leaves = {id(run): [None if isinstance(s, tuple) else s() for s in run.inputs] for run in runs.values()}
    complete = {slot for slot, found in wanted.items()
                if all(leaf is not None for run in _runs(found) for leaf, s in zip(leaves[id(run)], run.inputs)
                       if not isinstance(s, tuple))}
    if not complete:
        return None
    needed = sorted({id(run): run for slot in complete for run in _runs(wanted[slot])}.values(), key=lambda r: r.order)
    buffers, inputs, positions, held, slot_of = [], [], [], {}, {}

    def slot_for(tensor: torch.Tensor) -> int:
        if id(tensor) not in slot_of:
            slot_of[id(tensor)] = len(buffers)
            buffers.append(Buffer(tuple(tensor.shape), tensor.dtype, tensor.device))
            if id(tensor) in arguments:
                inputs.append(slot_of[id(tensor)])
                positions.append(arguments[id(tensor)])
            else:
                held[slot_of[id(tensor)]] = tensor
        return slot_of[id(tensor)]

    outputs_of: dict[int, list[int]] = {}
    kernels, steps = [], []
    for run in needed:
        ins = tuple(outputs_of[id(s[0])][s[1]] if isinstance(s, tuple) else slot_for(leaf)
                    for s, leaf in zip(run.inputs, leaves[id(run)]))
        outputs_of[id(run)] = list(range(len(buffers), len(buffers) + len(run.outputs)))
        buffers.extend(run.outputs)
        kernels.append((run.program, run.device))
        steps.append((ins, tuple(outputs_of[id(run)])))
    slots = sorted(complete)
    outputs = [outputs_of[id(wanted[slot][0])][wanted[slot][1]] for slot in slots]
    return FoldPlan(Plan(kernels, steps, buffers, inputs, outputs, held), positions, slots)
