"""CompiledGraph: a fixed sequence of kernel calls over numbered buffers, with a memory plan.

The runtime sees kernels and buffers, not operators. Each step calls its kernel as
`kernel(inputs, outputs)` with lists of torch tensors taken from numbered buffer slots. A slot
holds a graph input (bound at each run), a constant (a fixed tensor), a graph output
(allocated at each run, so results outlive the next run) or an intermediate.

Intermediates live in a workspace per device: a uint8 buffer carved into views at
256-byte-aligned offsets by a memory plan, so that buffers whose lifetimes do not overlap share
memory and a run allocates nothing but its outputs. The plan is greedy: buffers in order of
first use, or largest first, whichever needs less, each at the lowest offset where it overlaps
no buffer live at the same time.
A step whose program is a `View` runs nothing: its output slot is its input slot's tensor in
another shape (a reshape), and that memory stays live as long as either is used.

A captured CUDA graph copies some inputs into buffers of its own before each replay and some
outputs out of its buffers after it: those slots ("transient": they hold a value only during a
run) are planned in the workspace with the intermediates (an input from the run's start to its
last read, an output from its first write to the run's end), so that they share memory with
intermediates that are not live at the same time (`workspace_set(transient=...)`), and the
workspace may be memory the caller provides (shared by captures that never run at once).

A run may also be given inputs whose memory it may take after their last read (a consuming
training backward's saved values, `workspace_set(reused=...)`): intermediates and outputs go
there where they fit (`plan_with_regions`), the rest into the workspace.

Steps run in order (on a GPU, on the current stream). Runs that overlap in time never share a
workspace: each run checks a set of workspaces out of a pool and returns it when it ends. The
pool is keyed by the current stream of each CUDA device the graph uses, so that a workspace
whose kernels may still be queued on one stream is only reused by later runs on that stream
(stream order makes that safe); a run from another thread or stream takes another set, made
when none is free.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

ALIGNMENT = 256


@dataclass(frozen=True)
class Buffer:
    """The shape, dtype and device of one slot's tensor."""
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class Step:
    """One kernel call: `kernel(inputs, outputs)` on the tensors of these slots."""
    kernel: Callable
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]


@dataclass(frozen=True)
class View:
    """The program of a step whose output is its input's memory in the output's shape: a
    reshape of a contiguous tensor, which needs no kernel."""


class ViewKernel:
    """The kernel of a `View` step: the output slot already views the input's memory."""

    program = View()

    def __call__(self, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> None:
        pass


def _is_view(step: Step) -> bool:
    return isinstance(getattr(step.kernel, "program", None), View)


@dataclass(frozen=True)
class MemoryPlan:
    """Byte offsets of buffers in a workspace of `size` bytes."""
    offsets: dict[int, int]
    size: int


def lifetimes(steps: Sequence[Step]) -> dict[int, tuple[int, int]]:
    """For each slot that a step reads or writes: the (first, last) step index touching it."""
    out: dict[int, tuple[int, int]] = {}
    for k, step in enumerate(steps):
        for slot in (*step.inputs, *step.outputs):
            first = out.get(slot, (k, k))[0]
            out[slot] = (first, k)
    return out


def _align(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def plan_memory(sizes: dict[int, int], live: dict[int, tuple[int, int]],
                alignment: int = ALIGNMENT) -> MemoryPlan:
    """Offsets for buffers of `sizes` bytes live over the (first, last) step ranges `live`
    (inclusive): two buffers whose ranges intersect never overlap in memory. The smaller of two
    greedy plans, each buffer at the lowest offset where it overlaps no buffer placed already
    that is live at the same time: buffers in order of first use (larger first among those
    starting together), and largest first. The first alone left a training backward's large
    late buffers no hole among its small early ones (ResNet-50's workspace was 376 MB for 310 MB
    live at once at most, which the second reaches); the second alone is worse on some small
    graphs."""
    return min((_greedy_plan(order, sizes, live, alignment) for order in _orders(sizes, sizes, live)),
               key=lambda plan: plan.size)


def _orders(slots, sizes: dict[int, int], live: dict[int, tuple[int, int]]) -> tuple[list[int], list[int]]:
    """`slots` in the two orders the greedy plans try: by first use (larger first among those
    starting together), and largest first."""
    return (sorted(slots, key=lambda s: (live[s][0], -sizes[s], s)),
            sorted(slots, key=lambda s: (-sizes[s], live[s][0], s)))


def _greedy_plan(order: list[int], sizes: dict[int, int], live: dict[int, tuple[int, int]],
                 alignment: int, fixed: dict[int, int] | None = None) -> MemoryPlan:
    """Each buffer of `order` in turn at the lowest offset where it overlaps no buffer placed
    before it that is live at the same time, the buffers `fixed` (slot -> offset) placed first."""
    fixed = fixed or {}
    slots = list(fixed) + list(order)
    firsts = np.array([live[s][0] for s in slots], dtype=np.int64)
    lasts = np.array([live[s][1] for s in slots], dtype=np.int64)
    needs = np.array([_align(sizes[s], alignment) for s in slots], dtype=np.int64)
    offsets = np.array([fixed[s] for s in fixed] + [0] * len(order), dtype=np.int64)
    for k in range(len(fixed), len(slots)):
        together = (firsts[:k] <= lasts[k]) & (firsts[k] <= lasts[:k])
        starts = offsets[:k][together]
        ends = starts + needs[:k][together]
        at = np.argsort(starts, kind="stable")
        offset, need = 0, int(needs[k])
        for o, e in zip(starts[at].tolist(), ends[at].tolist()):
            if offset + need <= o:
                break
            offset = max(offset, e)
        offsets[k] = offset
    size = int((offsets + needs).max()) if len(slots) else 0
    return MemoryPlan({slot: int(o) for slot, o in zip(slots, offsets)}, size)


def plan_with_regions(sizes: dict[int, int], live: dict[int, tuple[int, int]],
                      regions: Sequence[Sequence[tuple[int, int, int]]], outputs: Sequence[int] = (),
                      alignment: int = ALIGNMENT) -> tuple[MemoryPlan, dict]:
    """`plan_memory` where some buffers may take memory that a run no longer needs: each of
    `regions` is one stretch of memory, listed as its parts (byte offset, bytes, last step),
    each the run's from after that step on (an input nobody reads afterwards); bytes of the
    stretch in no part are never the run's. Parts of one region that are free at once make one
    free span (a training forward's saved values, laid out side by side, as its backward reads
    them). The buffers `outputs` (live to the run's end) go into regions or nowhere, largest
    first; the others into regions or the workspace. Returns the workspace's plan (of the
    buffers not in regions, and of no output) and, for each buffer in a region, (the region's
    position in `regions`, its byte offset there)."""
    # the regions side by side, each part held by a buffer live up to its last step, the bytes
    # between parts and a wall after each region live at every step (no buffer straddles two
    # regions); the workspace after the last wall
    end = max([b for _, b in live.values()] + [last for parts in regions for _, _, last in parts] + [0])
    fixed, starts, at = {}, [], 0
    sizes, live = dict(sizes), dict(live)

    def hold(offset: int, nbytes: int, last: int) -> None:
        key = -1 - len(fixed)
        sizes[key], live[key], fixed[key] = nbytes, (0, last), at + offset

    for parts in regions:
        starts.append(at)
        usable = max(offset + nbytes for offset, nbytes, _ in parts) // alignment * alignment
        covered = 0
        for offset, nbytes, last in sorted(parts):
            first, stop = offset // alignment * alignment, min(_align(offset + nbytes, alignment), usable)
            if first > covered:
                hold(covered, first - covered, end)
            if stop > max(first, covered):
                hold(max(first, covered), stop - max(first, covered), last)
            covered = max(covered, stop)
        if usable > covered:
            hold(covered, usable - covered, end)
        hold(usable, alignment, end)
        at += usable + alignment
    span = at

    def region_of(offset: int) -> tuple[int, int]:
        k = int(np.searchsorted(starts, offset, side="right")) - 1
        return k, offset - starts[k]

    in_regions: dict[int, int] = {}
    for slot in _orders(outputs, sizes, live)[1]:
        offset = _greedy_plan([slot], sizes, live, alignment, {**fixed, **in_regions}).offsets[slot]
        if offset + _align(sizes[slot], alignment) <= span:
            in_regions[slot] = offset
    fixed.update(in_regions)
    outputs = set(outputs)
    best = None
    for order in _orders([s for s in sizes if s >= 0 and s not in outputs], sizes, live):
        plan = _greedy_plan(order, sizes, live, alignment, fixed)
        beyond = {s: plan.offsets[s] - span for s in order if plan.offsets[s] >= span}
        size = max([o + _align(sizes[s], alignment) for s, o in beyond.items()] + [0])
        if best is None or size < best[0].size:
            best = (MemoryPlan(beyond, size), {s: plan.offsets[s] for s in order if s not in beyond})
    workspace, placed = best
    placed.update(in_regions)
    return workspace, {s: region_of(o) for s, o in placed.items()}


def lent_layout(reused: dict[int, torch.Tensor]) -> frozenset:
    """Where the inputs a run may take after their last read (`reused`: input slot -> its
    tensor) lie, as `CompiledGraph.plans_with` reads it: (slot, block, byte offset) for each,
    the inputs sharing a storage one block (numbered by their first slot), offsets from the
    block's lowest input."""
    blocks: dict[int, list[int]] = {}
    for slot in sorted(reused):
        blocks.setdefault(reused[slot].untyped_storage().data_ptr(), []).append(slot)
    layout = set()
    for slots in blocks.values():
        start = {s: reused[s].data_ptr() for s in slots}
        low = min(start.values())
        layout.update((s, slots[0], start[s] - low) for s in slots)
    return frozenset(layout)


@dataclass(frozen=True)
class WorkspaceSet:
    """Workspaces by device, and each slot's tensor (views into them, and the constants);
    `transient` the input and output slots placed in the workspaces too; `together` the output
    slots each run allocates side by side in one block (`CompiledGraph.workspace_set`)."""
    workspaces: dict
    slots: list
    transient: frozenset = frozenset()
    together: tuple = ()


class CompiledGraph:
    """Steps over numbered buffers: `buffers[slot]` describes each slot; `inputs` are the slots
    bound by `run`, `outputs` the slots it returns, `constants` fixed tensors by slot. Every
    other slot is an intermediate, placed in its device's workspace. `workspaces` is the first
    workspace set's (runs that overlap in time make more). `plan` is the `kiln.runtime.plan.Plan`
    it was assembled from, where it was (what the graph cache and `kiln.save` store)."""

    def __init__(self, steps: Sequence[Step], buffers: Sequence[Buffer], inputs: Sequence[int],
                 outputs: Sequence[int], constants: dict[int, torch.Tensor], plan=None):
        self.plan = plan
        self.steps = list(steps)
        self.buffers = list(buffers)
        self.inputs = list(inputs)
        self.outputs = list(outputs)
        # each view slot and the slot whose memory it views, in step order
        self.views = {step.outputs[0]: step.inputs[0] for step in self.steps if _is_view(step)}
        self.lifetimes = lifetimes(self.steps)
        for view in reversed(list(self.views)):     # a view of a view: the later first
            first, last = self.lifetimes[view]
            base = self.views[view]
            self.lifetimes[base] = (min(first, self.lifetimes[base][0]), max(last, self.lifetimes[base][1]))
        external = set(self.inputs) | set(self.outputs) | set(constants) | set(self.views)
        self._intermediates = [s for s in range(len(self.buffers)) if s not in external]
        self._plans: dict[tuple, dict[torch.device, MemoryPlan]] = {}
        self._placements: dict[tuple, dict[int, tuple[int, int]]] = {}
        self.plans = self.plans_with(frozenset())
        self.constants = dict(constants)
        # non-contiguous constants are made contiguous at each run, so they follow their source
        self._strided = {s: t for s, t in constants.items() if not t.is_contiguous()}
        # the output slots each run allocates (every output but the inputs and constants returned)
        self.allocated_outputs = [s for s in dict.fromkeys(self.outputs) if s not in self.inputs and s not in constants]
        # views of memory that each run binds (inputs, outputs, contiguous copies of constants)
        per_run = set(self.inputs) | set(self.allocated_outputs) | set(self._strided)
        self._run_views = []
        for view, base in self.views.items():
            if base in per_run:
                self._run_views.append(view)
                per_run.add(view)
        self._lock = threading.Lock()
        self.loaded = False     # a CUDA graph capture built and loaded its kernels (`kiln.runtime.cuda_graph`)
        self._free: dict[tuple, list[WorkspaceSet]] = {}
        self._first: WorkspaceSet | None = None

    @property
    def workspaces(self) -> dict:
        """The workspaces (by device) of the pool's first set, made by the first run that
        needs one."""
        if self._first is None:
            self._checkin(*self._checkout())
        return self._first.workspaces

    def plans_with(self, transient: frozenset, reused: frozenset = frozenset()) -> dict[torch.device, MemoryPlan]:
        """The memory plan of each device's workspace holding the intermediates and the
        `transient` input and output slots (see the module doc), less what goes into the memory
        of the reused input slots after their last read (`reused`: their `lent_layout`;
        `placed_in_inputs`)."""
        key = (transient, reused)
        if key not in self._plans:
            end = len(self.steps) - 1
            live = dict(self.lifetimes)
            for slot in transient:
                first, last = live.get(slot, (0, end))
                live[slot] = (0, last) if slot in self.inputs else (first, end)
                if slot in self.inputs and slot in self.outputs:
                    live[slot] = (0, end)
            placed = self._intermediates + sorted(transient)
            blocks: dict[int, list[tuple[int, int]]] = {}
            for slot, block, offset in sorted(reused):
                if slot in self.inputs and slot in self.lifetimes:
                    blocks.setdefault(block, []).append((slot, offset))
            outputs = [s for s in self.allocated_outputs
                       if s not in transient and s not in self.views and s in live] if blocks else []
            for slot in outputs:
                live[slot] = (live[slot][0], end)
            plans, self._placements[key] = {}, {}
            for device in dict.fromkeys(self.buffers[s].device for s in placed + outputs):
                mine = [s for s in placed + outputs if self.buffers[s].device == device]
                theirs = [parts for parts in blocks.values() if self.buffers[parts[0][0]].device == device]
                if theirs:
                    # each region as its parts, from its lowest input, which anchors the placements
                    theirs = [sorted(parts, key=lambda p: p[1]) for parts in theirs]
                    plans[device], where = plan_with_regions(
                        {s: self.buffers[s].nbytes for s in mine}, live,
                        [[(offset - parts[0][1], self.buffers[s].nbytes, live[s][1]) for s, offset in parts]
                         for parts in theirs], outputs, ALIGNMENT)
                    self._placements[key].update({s: (theirs[k][0][0], offset) for s, (k, offset) in where.items()})
                else:       # outputs go nowhere but into inputs' memory
                    plans[device] = plan_memory({s: self.buffers[s].nbytes for s in mine if s not in outputs}, live)
            self._plans[key] = plans
        return self._plans[key]

    def placed_in_inputs(self, transient: frozenset, reused: frozenset) -> dict[int, tuple[int, int]]:
        """The slots that a run planned with `plans_with(transient, reused)` puts in the memory
        of a reused input after the last step reading it, each as (an input's slot, byte offset
        from its start): intermediates, and outputs (which then need no allocation of their
        own)."""
        self.plans_with(transient, reused)
        return self._placements[(transient, reused)]

    def transient_slots(self, inputs: Sequence[int] = (), outputs: Sequence[int] = ()) -> frozenset:
        """The slots of the inputs at positions `inputs` and of the outputs at positions `outputs`
        that a workspace may hold (inputs copied in, outputs copied out: neither a constant nor
        a view, and an output that is an input is left to the input)."""
        fixed = set(self.constants) | set(self.views)
        slots = {self.inputs[k] for k in inputs} | {self.outputs[k] for k in outputs
                                                     if self.outputs[k] not in self.inputs}
        return frozenset(s for s in slots if s not in fixed)

    def workspace_set(self, transient: frozenset = frozenset(), buffers: dict | None = None,
                      reused: dict[int, torch.Tensor] | None = None,
                      hosted: Callable[[torch.Tensor], torch.Tensor] = lambda piece: piece,
                      together: Sequence[int] = ()) -> "WorkspaceSet":
        """A new set of workspaces (one per device) and the slot tensors viewing into them,
        owned by whoever asked: `run(inputs, workspace=...)` uses it instead of the pool (a
        captured CUDA graph keeps one for its replays). The workspaces hold the `transient`
        slots too (`transient_slots`: the caller copies into those inputs and out of those
        outputs itself), and are `buffers` (uint8 tensors by device, of at least
        `plans_with(transient)`'s sizes) where given. With `reused` (input slot -> the
        contiguous tensor every run binds there), slots go into those inputs' memory after their
        last read (`placed_in_inputs`), each a view of `hosted(bytes of the input)`. The output
        slots `together` (one device's) that a run allocates are allocated as one block, side by
        side in the order the run writes them: a training forward's saved values, whose memory
        its backward, reading them in about the reverse order, then takes back in long stretches
        (`plan_with_regions`)."""
        reused = reused or {}
        layout = lent_layout(reused)
        plans = self.plans_with(frozenset(transient), layout)
        if buffers is None:
            workspaces = {device: torch.empty(plan.size, dtype=torch.uint8, device=device)
                          for device, plan in plans.items()}
        else:
            workspaces = {device: buffers[device][:plan.size] for device, plan in plans.items()}
        slots: list = [None] * len(self.buffers)
        for device, plan in plans.items():
            for slot, offset in plan.offsets.items():
                b = self.buffers[slot]
                slots[slot] = workspaces[device][offset:offset + b.nbytes].view(b.dtype).view(b.shape)
        placed = self.placed_in_inputs(frozenset(transient), layout) if reused else {}
        for slot, (region, offset) in placed.items():
            b, lender = self.buffers[slot], reused[region]
            # the bytes as a tensor of the input's storage that is no view (a view would keep
            # its base, the caller's tensor, alive too)
            start = lender.storage_offset() * lender.element_size() + offset
            piece = torch.empty(0, dtype=torch.uint8, device=lender.device).set_(
                lender.untyped_storage(), start, (b.nbytes,))
            slots[slot] = hosted(piece).view(b.dtype).view(b.shape)
        for slot, tensor in self.constants.items():
            slots[slot] = tensor
        for view, base in self.views.items():
            if slots[base] is not None:
                slots[view] = slots[base].view(self.buffers[view].shape)
        # outputs in reused memory are the set's, as transient ones are: the run allocates neither
        transient = frozenset(transient) | {s for s in placed if s in self.outputs}
        allocated = [s for s in dict.fromkeys(together) if s in self.allocated_outputs and s not in transient
                     and s not in self.views]
        return WorkspaceSet(workspaces, slots, transient, tuple(sorted(allocated, key=lambda s: self.lifetimes[s][0])))

    def _pool_key(self) -> tuple:
        """The current stream of each CUDA device with a workspace (CPU workspaces need none)."""
        return tuple(torch.cuda.current_stream(device).cuda_stream
                     for device in self.plans if device.type == "cuda")

    def _checkout(self) -> tuple[tuple, WorkspaceSet]:
        key = self._pool_key()
        with self._lock:
            free = self._free.setdefault(key, [])
            if free:
                return key, free.pop()
        made = self.workspace_set()
        with self._lock:
            if self._first is None:
                self._first = made
        return key, made

    def _checkin(self, key: tuple, workspace: WorkspaceSet) -> None:
        with self._lock:
            self._free[key].append(workspace)

    @property
    def workspace_bytes(self) -> int:
        """Bytes of all workspaces together."""
        return sum(plan.size for plan in self.plans.values())

    @property
    def intermediate_bytes(self) -> int:
        """Bytes the intermediates would take, each in its own allocation."""
        return sum(self.buffers[s].nbytes for plan in self.plans.values() for s in plan.offsets)

    def run(self, inputs: Sequence[torch.Tensor], workspace: "WorkspaceSet | None" = None) -> list[torch.Tensor]:
        """Run every step on `inputs` (torch tensors of the input slots' shapes and dtypes);
        return the output tensors, freshly allocated (inputs and constants returned as such).
        The intermediates go to a workspace set of the pool, or to `workspace` when given (its
        owner makes sure no two runs use it at once)."""
        if len(inputs) != len(self.inputs):
            raise ValueError(f"the compiled graph takes {len(self.inputs)} inputs, got {len(inputs)}")
        if workspace is not None:
            return self._run(inputs, list(workspace.slots), workspace.transient, workspace.together)
        key, taken = self._checkout()
        try:
            return self._run(inputs, list(taken.slots), taken.transient, taken.together)
        finally:
            self._checkin(key, taken)

    def _run(self, inputs: Sequence[torch.Tensor], slots: list, transient: frozenset,
             together: tuple = ()) -> list[torch.Tensor]:
        for slot, tensor in zip(self.inputs, inputs):
            if slot in transient:
                if slots[slot] is not tensor:
                    slots[slot].copy_(tensor)
            else:
                slots[slot] = tensor.contiguous()
        for slot, tensor in self._strided.items():
            slots[slot] = tensor.contiguous()
        for slot in self.allocated_outputs:
            if slot not in transient and slot not in together:
                b = self.buffers[slot]
                slots[slot] = torch.empty(b.shape, dtype=b.dtype, device=b.device)
        if together:
            self._allocate_together(slots, together)
        for view in self._run_views:
            slots[view] = slots[self.views[view]].view(self.buffers[view].shape)
        for step in self.steps:
            step.kernel([slots[s] for s in step.inputs], [slots[s] for s in step.outputs])
        return [slots[s] for s in self.outputs]

    def _allocate_together(self, slots: list, together: tuple) -> None:
        """The output slots `together` as views of one new block, each at an aligned offset."""
        offsets, size = [], 0
        for slot in together:
            offsets.append(size)
            size += _align(self.buffers[slot].nbytes, ALIGNMENT)
        block = torch.empty(size, dtype=torch.uint8, device=self.buffers[together[0]].device)
        for slot, offset in zip(together, offsets):
            b = self.buffers[slot]
            slots[slot] = block[offset:offset + b.nbytes].view(b.dtype).view(b.shape)

    def __repr__(self) -> str:
        return (f"CompiledGraph({len(self.steps)} steps, workspace {self.workspace_bytes} bytes "
                f"for {self.intermediate_bytes} bytes of intermediates)")
