"""CUDA graph capture and replay of a sequence of GPU launches.

`CapturedGraph(fn, example_inputs)` runs `fn` once to build and load every kernel, then
captures one more call into a CUDA graph over static input buffers. `run(inputs)` copies the
inputs into those buffers and replays the graph: one launch for the whole sequence, without
Python or driver overhead per kernel. The outputs are the graph's static buffers, overwritten
by the next replay, unless `run(inputs, copy=True)` returns copies of them.

Inputs named `bound` are not copied: the graph is captured on the example tensors themselves
(an in-place update of a caller's tensor, such as a KV cache written at every decoding step,
then costs no copy in or out). A bound graph replays only for inputs at the memory it was
captured on (`run` returns None otherwise). The warm-up call that loads the kernels runs on
copies of the bound inputs named `written` (those `fn` writes into), so the capture writes
nothing the caller can see, and on the other inputs themselves (the static buffers of those
copied in): warming up a training step's backward then costs no second copy of its saved values.

Outputs named `lent` (a training forward's values saved for the backward, which no caller but
autograd sees) are handed out without a copy: the caller gets aliases of the static buffers.
While any alias of one is alive (the storage's use count above what the graph holds itself),
the graph is `busy` and `run` returns None instead of overwriting it; the owner runs another
capture or no CUDA graph. A graph captured with a tensor that `stays_put` as a bound input (the
backward, on the forward's saved values: lent outputs, and the parameters the forward reads in
place) reads it in place, so a training step copies neither its saved values out of the forward
nor into the backward, and keeps no second copy of the parameters.

`capture(compiled, example_inputs)` captures a CompiledGraph this way (what
`FlowGraph.cuda_graph` and the torch backend's runs use), over a `SharedWorkspace`: the captures
of a device keep their intermediates in one buffer, as large as the largest workspace among
them, since their replays never overlap. A new capture that needs more starts a larger buffer,
which later captures share; the captures on the smaller one are retired first (they let go of
it, so that it is freed before the larger one is allocated, and never replay again) and are then
`stale`: their owner captures them again (a training step's forward, captured before its
backward needed more, moves to the backward's workspace at the next step; the backward's capture
reading the old forward's lent values is then `orphaned`: no live graph lends them any more).
The inputs a capture copies in, and the outputs it copies out (with `copied_out`), are planned
in that workspace too, by lifetime (`kiln.runtime.compiled_graph`): a training step's forward,
backward and the graphs between them hold one workspace, not one each beside a static buffer for
every value passed from one graph to the next.

A consuming backward (`capture(..., reused=...)`, with the `reuse_saved_memory` setting) also
puts its intermediates and gradients in the memory of the forward's saved values once it has
read them: the forward marks those lent outputs `private` (only autograd sees them), and the
backward's views of that memory have storages of their own (`hosted_view`), so that the forward
tells their holds from a caller's. It replays only where autograd keeps no graph and no
saved_tensors_hooks saw the values (`CapturedGraph.consumable`); its gradients there keep the
forward `busy` while a caller holds them. Its warm-up runs on a workspace of its own (the plan
that reuses no saved memory, its gradients beside it), freed before the shared workspace grows
to the capture's size, or not at all where the driver loads kernels inside a capture (CUDA 12.3
and later) or an earlier capture of the graph loaded its kernels. A step that does not allow it
(a retained graph, saved_tensors_hooks) captures a backward that does not consume, and that
capture goes on serving the steps after it. The first consuming capture, made on a forward
capture that its own larger workspace retired, serves one replay: the owner keeps that workspace
(`CapturedGraph.workspace`), so that the next forward captures on it and the steps from then on
replay.

A graph has one set of static buffers, so its replays are serialized: one thread at a time
copies in, replays and copies out, all on the caller's current stream (of the graph's device);
a replay on another stream than the last replay's first makes its stream wait for that one.
Captures sharing a workspace are serialized together, in the same way (`Ordering`).
"""
from __future__ import annotations

import threading
import weakref
from typing import Callable, Sequence

import torch

from kiln.log import logger
from kiln.runtime import cuda
from kiln.runtime.compiled_graph import lent_layout

_capturing = threading.Lock()

# torch's C++ comparison of many tensors' addresses (CUDA builds of torch have it)
_addresses_equal = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)


_holders: weakref.WeakSet = weakref.WeakSet()       # the live graphs with lent outputs or bound inputs


def stays_put(tensor: torch.Tensor) -> bool:
    """Whether `tensor` starts at a lent output or a bound input of a live captured graph:
    memory that graph keeps using from replay to replay."""
    address = tensor.data_ptr()
    return any(address in graph.lent_addresses or address in graph.bound_addresses for graph in list(_holders))


class Ordering:
    """What serializes the replays of graphs sharing memory: a lock held while one copies in,
    replays and copies out, and the stream of the last work on that memory."""

    def __init__(self, stream):
        self.lock = threading.Lock()
        self.last_stream = stream


class SharedWorkspace(Ordering):
    """A workspace buffer (uint8, of `nbytes` on a CUDA `device`) that captured graphs share,
    their replays serialized by this `Ordering`."""

    def __init__(self, nbytes: int, device: torch.device):
        super().__init__(torch.cuda.current_stream(device))
        self.buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.superseded = False         # a larger one serves the device's new captures
        self.users: weakref.WeakSet = weakref.WeakSet()     # the live graphs captured on it

    def supersede(self) -> None:
        """Retire the graphs captured on this workspace, which a larger one replaces, and let go
        of the buffer: it is freed before the larger one is allocated."""
        self.superseded = True
        for graph in list(self.users):
            graph.retire()
        self.buffer = None


_workspaces: weakref.WeakValueDictionary = weakref.WeakValueDictionary()   # device -> SharedWorkspace
_workspaces_lock = threading.Lock()


def shared_workspace(device: torch.device, nbytes: int) -> SharedWorkspace:
    """The device's shared workspace, or a new one (which later captures share) where it is
    smaller than `nbytes` or none is alive; captures on the older one keep it."""
    with _workspaces_lock:
        current = _workspaces.get(device)
        if current is None or current.buffer.numel() < nbytes:
            if current is not None:
                current.supersede()
            current = _workspaces[device] = SharedWorkspace(nbytes, device)
        return current


def _use_count(storage) -> int:
    return torch._C._storage_Use_Count(storage._cdata)


_hosted: dict[int, list] = {}       # a lent storage's address -> weak references to the storages hosted in it
_hosted_lock = threading.Lock()


def hosted_view(piece: torch.Tensor) -> torch.Tensor:
    """`piece` (bytes of a graph's lent output) as a tensor with a storage of its own, which keeps
    the lent output's memory alive: the lender's `busy` counts aliases of its lent outputs by
    their storages' use counts, and tells this storage's holds on its memory from a caller's."""
    view = torch.from_dlpack(piece)
    with _hosted_lock:
        _hosted.setdefault(piece.untyped_storage().data_ptr(), []).append(_weak(view.untyped_storage()))
    return view


def _weak(storage):
    from torch.multiprocessing.reductions import StorageWeakRef
    return StorageWeakRef(storage)


def _hosting(storage) -> int:
    """How many storages of `hosted_view`s over `storage` are alive (each holds it once)."""
    address = storage.data_ptr()
    with _hosted_lock:
        refs = _hosted.get(address)
        if not refs:
            return 0
        live = [ref for ref in refs if not ref.expired()]
        if live:
            _hosted[address] = live
        else:
            del _hosted[address]
        return len(live)


def _held_beyond(storage, own: int) -> bool:
    """Whether something holds `storage` beyond the `own` holds of its graph and the
    `hosted_view`s over it (those are looked up only where the use count exceeds `own`: every
    replay checks every lent output)."""
    count = _use_count(storage)
    return count > own and count > own + _hosting(storage)


def keeps_graph() -> bool:
    """Whether autograd keeps the graph after the backward running now (`retain_graph`, a
    backward of a backward; True outside a backward): then a backward must not reuse the
    memory of the values saved for it."""
    keeps = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if keeps is None else keeps()


def _saving_through_hooks() -> bool:
    """Whether autograd passes saved values through `saved_tensors_hooks` now (a hook may keep
    them: a backward must then not reuse their memory)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is None or top(False) is not None


def private_lender(tensor: torch.Tensor) -> "CapturedGraph | None":
    """The live graph that lent `tensor` as one of its `private` outputs (a value saved for the
    backward, which only autograd sees), if any."""
    address = tensor.data_ptr()
    return next((g for g in list(_holders) if address in g.private_addresses), None)


def same_addresses(tensors: list[torch.Tensor], addresses: list[int]) -> bool:
    """Whether each of `tensors` starts at the address of the same position in `addresses`."""
    if _addresses_equal is not None:
        return _addresses_equal(tensors, addresses, list(range(len(tensors))))
    return list(map(torch.Tensor.data_ptr, tensors)) == addresses


def layout_check(examples: Sequence[torch.Tensor]) -> Callable[[Sequence], bool]:
    """A check, run in C, that a sequence of tensors has the sizes, strides, dtypes and devices
    of `examples`, one for one (dynamo's TensorGuards, which compare the dispatch keys too:
    requires_grad and the like). It returns False, never raises, for anything else (other
    lengths, objects that are not tensors), and always where this torch lacks TensorGuards:
    the caller then checks in Python."""
    try:
        from torch._C._dynamo.guards import TensorGuards
        guards = TensorGuards(*examples, dynamic_dims_sizes=[list(t.shape) for t in examples],
                              dynamic_dims_strides=[list(t.stride()) for t in examples])
    except Exception:
        return lambda tensors: False
    count = len(examples)

    def check(tensors: Sequence) -> bool:
        try:
            return len(tensors) == count and guards.check(*tensors)
        except Exception:
            return False
    return check


class CapturedGraph:
    """A captured CUDA graph of `fn(inputs) -> list of torch tensors`. The graph keeps `fn`:
    the buffers it closes over (a workspace) are what the captured kernels read and write.
    `bound` lists the positions of the inputs captured at the example tensors' own memory
    (contiguous tensors), which `run` then takes in place instead of copying (the graph keeps
    their addresses, not the tensors), and `written` those of them `fn` writes into (all bound
    inputs unless given); `lent` the positions of the outputs `run` hands out without a copy
    (see the module doc); an output that is a bound input `fn` does not write is handed out as
    the caller's tensor. `buffers` gives the static buffers of some copied inputs by position
    (slots of a workspace, which `fn` reads them from) instead of copies of the examples; an
    `ordering` shared with other graphs serializes its replays with theirs (they share memory)."""

    def __init__(self, fn: Callable[[list[torch.Tensor]], list], example_inputs: Sequence[torch.Tensor],
                 wrap: Callable = lambda t: t, bound: Sequence[int] = (), lent: Sequence[int] = (),
                 written: Sequence[int] | None = None, buffers: dict[int, torch.Tensor] | None = None,
                 ordering: Ordering | None = None, private: Sequence[int] = (), lenders: Sequence = (),
                 warm_up: Callable[[list[torch.Tensor]], list] | None = None):
        self.wrap = wrap
        self.fn = fn
        self.bound = sorted(set(bound))
        written = set(self.bound if written is None else written)
        for k in self.bound:
            if not example_inputs[k].is_contiguous():
                raise ValueError(f"a bound input must be contiguous: input {k} has strides "
                                 f"{example_inputs[k].stride()} for shape {list(example_inputs[k].shape)}")
        self._input_types = [(t.shape, t.dtype) for t in example_inputs]
        self._same_layout = layout_check(example_inputs)
        buffers = buffers or {}
        self._copied = [k for k in range(len(example_inputs)) if k not in self.bound]
        self._bound_addresses = [example_inputs[k].data_ptr() for k in self.bound]
        self.bound_addresses = set(self._bound_addresses)
        # the bound positions and their addresses, for `moved_inputs` (holding them does not
        # keep the graph alive)
        self.binding = (tuple(self.bound), tuple(self._bound_addresses))
        # the bound inputs that are other graphs' lent outputs
        self.borrowed = {a for a in self.bound_addresses if any(a in g.lent_addresses for g in list(_holders))}
        stream = torch.cuda.Stream()
        self._order = ordering or Ordering(stream)
        self.retired = False
        if self.workspace is not None:
            ordering.users.add(self)
        with self._order.lock:
            current = torch.cuda.current_stream()
            current.wait_stream(self._order.last_stream)
            static_inputs = [t if k in self.bound else buffers[k].copy_(t) if k in buffers
                             else t.detach().clone() for k, t in enumerate(example_inputs)]
            stream.wait_stream(current)
            with torch.cuda.stream(stream):
                # builds and loads every kernel before capture
                (warm_up or fn)(warm_up_inputs(static_inputs, written))
                self.graph = torch.cuda.CUDAGraph()
                # thread_local: CUDA calls of other threads (eager work, another model's run) stay
                # legal during the capture; one capture at a time in the process
                with _capturing, torch.cuda.graph(self.graph, stream=stream, capture_error_mode="thread_local"):
                    self.static_outputs = list(fn(static_inputs))
            self._order.last_stream = stream        # the stream of the last work on the static buffers
        torch.cuda.current_stream().wait_stream(stream)
        self.static_inputs = [None if k in self.bound else t for k, t in enumerate(static_inputs)]
        # an output that is an input the graph does not write (a parameter a training forward
        # saves for its backward, or the logits a loss graph saves) is handed out as the caller's
        # tensor: a bound one always, a copied one where the caller's is contiguous (as the copy
        # would be), instead of a copy of the static buffer
        unwritten = set(range(len(static_inputs))) - written
        self._passed = {k: j for k, t in enumerate(self.static_outputs) for j in unwritten if t is static_inputs[j]}
        self._bound_set = frozenset(self.bound)
        # a bound input returned is the caller's tensor at every replay: the graph holds no
        # reference to the example's (another graph's lent output, which would stay busy)
        for k, j in self._passed.items():
            if j in self._bound_set:
                self.static_outputs[k] = None
        self.lent = sorted(set(lent))
        held = [self.static_outputs[k] for k in self.lent if self.static_outputs[k] is not None]
        # one storage may hold several lent outputs (`_side_by_side`)
        storages = list({t.untyped_storage().data_ptr(): t.untyped_storage() for t in held}.values())
        # what the graph's own tensors count, before any alias is handed out
        self._lent_storages = [(storage, _use_count(storage)) for storage in storages]
        self.lent_addresses = {t.data_ptr() for t in held}
        # lent outputs no caller but autograd sees (sharing no memory with another output), whose
        # memory a consuming backward may reuse after reading them
        private = {k for k in private if k in self.lent and self.static_outputs[k] is not None}
        shared = {t.untyped_storage().data_ptr() for k, t in enumerate(self.static_outputs)
                  if k not in private and t is not None}
        self.private_addresses = {self.static_outputs[k].data_ptr() for k in private
                                  if self.static_outputs[k].untyped_storage().data_ptr() not in shared}
        self.saved_under_hooks = False      # the last replay's private outputs went through saved_tensors_hooks
        # a consuming backward: it reuses memory of the lenders' private outputs, so it replays
        # only where autograd is done with them (`consumable`); its lent outputs there (`_guest`)
        # keep each lender busy while a caller holds them, even once this graph is retired
        self.consumes = bool(lenders)
        # a lender retired while this one was captured (its workspace superseded) never lends
        # again: this graph serves the one replay under way, then lets go of the lender's memory
        self._last = any(lender.retired for lender in lenders)
        self.lenders = weakref.WeakSet(lenders)
        self.guests: weakref.WeakSet = weakref.WeakSet()
        for lender in lenders:
            lender.guests.add(self)
        self._guest = [_weak(storage) for storage, _ in self._lent_storages] if lenders else []
        if self.lent or self.bound:
            _holders.add(self)

    @property
    def workspace(self) -> SharedWorkspace | None:
        """The device's shared workspace it was captured on (None: a workspace of its own, or
        retired)."""
        return self._order if isinstance(self._order, SharedWorkspace) else None

    def busy(self) -> bool:
        """Whether an alias of a lent output of an earlier replay is still alive (a consuming
        backward's outputs in this graph's memory count too)."""
        return (any(_held_beyond(storage, own) for storage, own in self._lent_storages)
                or any(guest.guest_busy() for guest in list(self.guests)))

    def guest_busy(self) -> bool:
        """Whether a caller holds an output of a replay of this consuming backward, which may be
        in its lenders' memory (retired or not: the outputs stay where they are; once retired,
        whatever holds their storages is a caller)."""
        if self.retired:
            return any(not ref.expired() for ref in self._guest)
        return bool(self._guest) and self.busy()

    def stale(self) -> bool:
        """Whether the shared workspace it was captured on serves no new captures any more."""
        return self.retired or getattr(self._order, "superseded", False)

    def retire(self) -> None:
        """Never replay again, and let go of the graph and every buffer: what its captured
        kernels read and write is freed once nothing else holds it (a caller's alias of a lent
        output keeps that output's memory). A retired graph is never `busy`."""
        with self._order.lock:
            if self.retired:
                return
            self.retired = True
            self.fn = self.graph = self.static_inputs = self.static_outputs = None
            self._lent_storages = []
            self._order = Ordering(self._order.last_stream)
            guests = list(self.guests)
        for guest in guests:            # their captures read this one's memory: they never bind again
            guest.retire()

    def consumable(self) -> bool:
        """Whether this replay may reuse the memory of the values its lenders saved: autograd
        keeps no graph, and no hook saw those values."""
        return not keeps_graph() and not any(lender.saved_under_hooks for lender in list(self.lenders))

    def orphaned(self) -> bool:
        """Whether a bound input it read from another graph's lent output is lent by no live
        graph any more (that graph's capture is gone: this one never binds again)."""
        lent = set().union(*(g.lent_addresses for g in list(_holders) if g is not self))
        return not self.borrowed <= lent

    def binds(self, inputs: Sequence[torch.Tensor]) -> bool:
        """Whether the bound positions of `inputs` (torch tensors) are the captured tensors'
        memory, contiguous."""
        mine = [inputs[k] for k in self.bound]
        return same_addresses(mine, self._bound_addresses) and all(t.is_contiguous() for t in mine)

    def run(self, inputs: Sequence[torch.Tensor], copy: bool = False) -> list | None:
        """Copy `inputs` (torch tensors, or objects with `.torch()`) into the graph's buffers,
        replay it on its device's current stream (after the last replay's work, on whatever
        stream that ran) and return its static outputs (their copies with `copy`, which later
        replays leave alone; lent outputs as aliases), each passed through `wrap`. None, with
        nothing run, when the bound inputs are not at the memory the graph was captured on or
        the graph is `busy`."""
        if self._same_layout(inputs):       # the examples' layouts: bound inputs are contiguous
            sources = inputs
            if self.bound and not same_addresses([inputs[k] for k in self.bound], self._bound_addresses):
                return None
        else:
            if len(inputs) != len(self._input_types):
                raise ValueError(f"the captured graph takes {len(self._input_types)} inputs, got {len(inputs)}")
            sources = [src.torch() if hasattr(src, "torch") else src for src in inputs]
            for (shape, dtype), src in zip(self._input_types, sources):
                if src.shape != shape or src.dtype != dtype:
                    raise ValueError(f"captured graph input expects {dtype}{list(shape)}, got "
                                     f"{src.dtype}{list(src.shape)}")
            if self.bound and not self.binds(sources):
                return None
        order = self._order
        with order.lock:
            if self.retired or self.busy() or (self.consumes and not self.consumable()):
                return None
            stream = torch.cuda.current_stream(order.last_stream.device)
            if stream != order.last_stream:
                stream.wait_stream(order.last_stream)
                order.last_stream = stream
            for k in self._copied:
                self.static_inputs[k].copy_(sources[k], non_blocking=True)
            self.graph.replay()
            if self.private_addresses:
                self.saved_under_hooks = _saving_through_hooks()
            lent = set(self.lent)
            passed, bound = self._passed, self._bound_set
            outputs = [sources[j] if (j := passed.get(k)) is not None and (j in bound or sources[j].is_contiguous())
                       else t.detach() if k in lent else t.clone() if copy else t
                       for k, t in enumerate(self.static_outputs)]
        if self._last:
            self.retire()
        return [self.wrap(t) for t in outputs]


def moved_inputs(binding: tuple[Sequence[int], Sequence[int]], inputs: Sequence[torch.Tensor]) -> list[int]:
    """The bound positions of `inputs` (torch tensors) not at the memory a graph was captured
    on, by its `CapturedGraph.binding`."""
    positions, addresses = binding
    return [k for k, address in zip(positions, addresses) if inputs[k].data_ptr() != address]


def warm_up_inputs(static_inputs: Sequence[torch.Tensor], written: Sequence[int]) -> list[torch.Tensor]:
    """The inputs of a capture's warm-up call: copies of those at positions `written` (the
    caller's tensors the call writes into), the others as they are (read only, or the graph's
    own static buffers, copied into before each replay)."""
    written = set(written)
    return [t.detach().clone() if k in written else t for k, t in enumerate(static_inputs)]


def capture(compiled, example_inputs: Sequence[torch.Tensor], write_back: Sequence[tuple[int, int]] = (),
            wrap: Callable = lambda t: t, lent: Sequence[int] = (), bound: Sequence[int] = (),
            copied_out: bool = False, private: Sequence[int] = (), reused: Sequence[int] = ()) -> CapturedGraph:
    """`compiled` (a `kiln.runtime.compiled_graph.CompiledGraph` on CUDA) captured in a CUDA
    graph over the device's shared workspace (see the module doc; a workspace of its own where
    the graph's intermediates are on several devices), on `example_inputs` (torch
    tensors, used only for the capture). Each pair (output, input) of `write_back` makes the
    replay copy that output into that input, which the graph then takes in place (bound at the
    example's memory): replays update the caller's tensor and return the other outputs only,
    each passed through `wrap`. Of those, the positions `lent` that the graph allocates itself
    (not inputs or constants) are lent rather than copied, and those of them at `private` are
    values only autograd sees (a training forward's saved values); the inputs at positions
    `bound` are read in place, the others copied into the workspace. With `copied_out` (the
    caller always runs with `copy=True`), the outputs neither lent nor written back are in the
    workspace too. The bound inputs at positions `reused` that are private outputs of live
    graphs (a backward's saved values) lend the graph their memory after its last read of them:
    its intermediates and outputs go there where they fit (a consuming backward, which then
    replays only where autograd is done with those values: `CapturedGraph.consumable`)."""
    written = {out for out, _ in write_back}
    returned = [k for k in range(len(compiled.outputs)) if k not in written]
    allocated = set(compiled.allocated_outputs)
    lent = [j for j in lent if compiled.outputs[returned[j]] in allocated]
    bound = [position for _, position in write_back] + list(bound)
    copied = [k for k in range(len(example_inputs)) if k not in bound]
    transient_outputs = list(written) + ([k for j, k in enumerate(returned) if j not in lent] if copied_out else [])
    # a lent output lives on after the replay (and the memory it views); without copied_out,
    # so does an input returned
    kept = {compiled.outputs[returned[j]] for j in lent} | (set() if copied_out else set(compiled.outputs))
    for slot in list(kept):
        while slot in compiled.views:
            slot = compiled.views[slot]
            kept.add(slot)
    transient = frozenset(compiled.transient_slots(inputs=copied, outputs=transient_outputs) - kept)
    regions, lenders = _lent_memory(compiled, example_inputs, [k for k in reused if k in bound[len(write_back):]])
    together = _side_by_side(compiled, returned, [j for j in private if j in lent])

    def body(inputs, workspace):
        outs = compiled.run(inputs, workspace)
        # an output that is an input written back keeps the value from before the write-back
        # (one the graph updated in place is its final value: nothing is copied back into it)
        targets = [inputs[position] for out, position in write_back if outs[out] is not inputs[position]]
        outs = [t.clone() if k not in written and any(t is w for w in targets) else t for k, t in enumerate(outs)]
        for out, position in write_back:
            if outs[out] is not inputs[position]:   # an input the graph updated in place is the value
                inputs[position].copy_(outs[out])
        return [t for k, t in enumerate(outs) if k not in written]

    written_positions = [position for _, position in write_back]
    if regions and not compiled.loaded and not cuda.loads_kernels_in_capture():
        # the run that loads the kernels must leave the lent memory alone (the replay after the
        # capture reads it) and the shared workspace too (it holds the static inputs): it runs on
        # a workspace of its own, freed before the shared workspace grows to this capture's size,
        # which would otherwise be allocated beside it. A driver that loads kernels inside the
        # capture needs no such run.
        logger.debug("a run on a workspace of its own before a capture reusing lent memory")
        body(warm_up_inputs(example_inputs, written_positions), compiled.workspace_set(transient))
    plans = compiled.plans_with(transient, lent_layout(regions))
    ordering = None
    if len(plans) == 1 and next(iter(plans)).type == "cuda":
        [(device, plan)] = plans.items()
        ordering = shared_workspace(device, plan.size)
        workspace = compiled.workspace_set(transient, buffers={device: ordering.buffer}, reused=regions,
                                           hosted=hosted_view, together=together)
    else:
        workspace = compiled.workspace_set(transient, reused=regions, hosted=hosted_view, together=together)
    buffers = {k: workspace.slots[compiled.inputs[k]] for k in copied if compiled.inputs[k] in transient}

    captured = CapturedGraph(lambda inputs: body(inputs, workspace), example_inputs, wrap=wrap, bound=bound,
                             lent=lent, written=written_positions, buffers=buffers, ordering=ordering,
                             private=private, lenders=lenders,
                             warm_up=_loaded if regions or compiled.loaded else None)
    compiled.loaded = True
    return captured


def _loaded(inputs) -> None:
    """The warm-up of a capture whose kernels are loaded already (a consuming capture, or one
    after the first of its compiled graph, whose run loaded everything it launches): nothing to
    run."""


def _side_by_side(compiled, returned: Sequence[int], private: Sequence[int]) -> list[int]:
    """The slots of the `private` outputs (positions in `returned`, the output positions a capture
    hands out) that a capture allocates side by side in one block (`workspace_set(together=...)`,
    which leaves out views and what it does not allocate): those on the first one's device whose
    memory no other output views."""
    def base(slot):
        while slot in compiled.views:
            slot = compiled.views[slot]
        return slot

    positions = {returned[j] for j in private}
    others = {base(s) for k, s in enumerate(compiled.outputs) if k not in positions}
    slots = [s for s in dict.fromkeys(compiled.outputs[k] for k in sorted(positions)) if s not in others]
    device = compiled.buffers[slots[0]].device if slots else None
    return [s for s in slots if compiled.buffers[s].device == device]


def _lent_memory(compiled, inputs: Sequence[torch.Tensor], positions: Sequence[int]) -> tuple[dict, list]:
    """Of the `inputs` at `positions`, those a capture of `compiled` may reuse after reading
    them: contiguous private outputs of live graphs whose last replay no saved_tensors_hooks
    saw, whose memory no other input shares, by input slot; and their lenders."""
    def memory(t):
        if t.is_contiguous():     # the bytes it spans (lent outputs may lie side by side in one storage)
            return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
        start = t.untyped_storage().data_ptr()
        return start, start + t.untyped_storage().nbytes()

    spans = [memory(t) if isinstance(t, torch.Tensor) else None for t in inputs]
    regions, lenders = {}, []
    for k in positions:
        tensor, slot = inputs[k], compiled.inputs[k]
        lender = private_lender(tensor) if tensor.is_contiguous() else None
        # memory another input also views is read through that input too: left alone
        start, end = spans[k]
        if (lender is None or lender.retired or lender.saved_under_hooks or slot in regions
                or any(j != k and span is not None and span[0] < end and start < span[1] for j, span in enumerate(spans))):
            continue
        regions[slot] = tensor
        if lender not in lenders:
            lenders.append(lender)
    return regions, lenders
