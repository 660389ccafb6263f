"""Operators: a name and a compute definition, called on tensors.

    @operator("relu")
    def relu(x):
        return compute(x.shape, lambda *i: maximum(x[i], 0))

The definition receives a `TensorInput` for each tensor argument (a list of them for a list of
tensors) and every other argument as it was given (an attribute). Called with concrete tensors
an operator runs at once; called with a symbolic one it records a node of a graph.

A value computed from no data (an operator with no tensor input, such as a fill or a range, and
whatever is computed from such values alone) is *generated*. While a graph is being built
(`tracing()`), a generated value larger than GENERATED_BYTES_HELD is recorded as a node even
though no input is symbolic: the graph computes it where it is used (a fill fuses into its
reader) instead of holding it as a constant for as long as the graph lives.
"""
from __future__ import annotations

import contextlib
import contextvars
import inspect
import math
import re
import threading
from collections import OrderedDict
from typing import Callable

import torch

from kiln.device import Device, device as as_device
from kiln.graph.traits import Traits
from kiln.ir.compute import Task, TensorInput, TensorNode
from kiln.ir import size_reads
from kiln.ir.size import SymSize, size_key
from kiln.ir.specialize import has_symbolic_sizes
from kiln.log import current_record
from kiln.runtime import folds
from kiln.schedule import build_task
from kiln.settings import Settings
from kiln.tensor import Tensor, from_torch


class OperatorError(ValueError):
    """An operator was called with arguments it does not support."""


TASKS_KEPT = 256
"""The most Tasks an operator definition keeps, one per combination of input shapes, dtypes and
attributes it was called with; the least recently used goes first (called so again, the
definition builds its Task again)."""

KERNELS_KEPT = 256
"""The most built kernels `compiled_task` keeps for tasks that may be run again; the least
recently used goes first. A CompiledGraph holds its own kernels, whatever this keeps."""


GENERATED_BYTES_HELD = 1 << 16
"""The largest generated value (in bytes, all outputs of its operator together) that an operator
computes at once while a graph is traced, so that the graph holds it as a constant."""

_tracing: contextvars.ContextVar[bool] = contextvars.ContextVar("kiln_tracing", default=False)


@contextlib.contextmanager
def tracing():
    """The context of building a graph (the torch frontend's interpreter and every graph pass
    run in it): inside, an operator whose result is generated and larger than
    GENERATED_BYTES_HELD records a node instead of running."""
    token = _tracing.set(True)
    try:
        yield
    finally:
        _tracing.reset(token)


def _recorded_generated(task: Task) -> bool:
    """Whether a generated result of `task` is recorded rather than computed now: while
    tracing, where it is large or computed from symbolic sizes (held as a constant, it would
    tie the graph's plan to one size: `kiln.frontend.torch.plan_reuse`)."""
    if not _tracing.get():
        return False
    return (has_symbolic_sizes(task)
            or sum(math.prod(o.shape) * o.dtype.nbytes for o in task.outputs) > GENERATED_BYTES_HELD)


class Recent:
    """A mapping, safe across threads, that keeps its `limit()` most recently used entries."""

    def __init__(self, limit: Callable[[], int]):
        self._entries: OrderedDict = OrderedDict()
        self._limit = limit
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key):
        """The value of `key` (now the most recently used), or None. While symbolic sizes'
        reads are recorded (`kiln.ir.size_reads`), only what the recording put."""
        recorded = size_reads.current()
        if recorded is not None:
            return recorded.cache(self).get(key)
        with self._lock:
            found = self._entries.get(key)
            if found is not None:
                self._entries.move_to_end(key)
            return found

    def put(self, key, value) -> None:
        """Keep `value` under `key`, dropping the least recently used entries beyond the limit
        (while reads are recorded, in the recording)."""
        recorded = size_reads.current()
        if recorded is not None:
            recorded.cache(self)[key] = value
            return
        with self._lock:
            self._entries[key] = value
            self._entries.move_to_end(key)
            while len(self._entries) > self._limit():
                self._entries.popitem(last=False)


def _camel(name: str) -> str:
    return "".join(p[:1].upper() + p[1:] for p in re.split(r"[_\W]+", name) if p)


class OperatorDef:
    """An operator definition: its name, the function that builds its Task, and its traits
    (`kiln.graph.Traits`, what the graph passes read of it)."""

    def __init__(self, name: str, definition: Callable, display_name: str | None = None,
                 override: bool = False, traits: Traits = Traits()):
        self.name = name
        self.definition = definition
        self.display_name = display_name or _camel(name)
        self.override = override
        self.traits = traits
        self.signature = inspect.signature(definition)
        self.__doc__ = definition.__doc__
        self._tasks = Recent(lambda: TASKS_KEPT)

    def __repr__(self) -> str:
        return f"<operator {self.name}>"

    def bind(self, args, kwargs) -> dict:
        """Arguments by parameter name, defaults applied; torch tensors become Kiln tensors."""
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise OperatorError(f"{self.name}: {exc}; signature is {self.name}{self.signature}") from None
        bound.apply_defaults()
        out = {}
        for k, v in bound.arguments.items():
            if isinstance(v, torch.Tensor):
                v = from_torch(v)
            elif isinstance(v, (list, tuple)) and any(isinstance(x, (Tensor, torch.Tensor)) for x in v):
                v = [from_torch(x) if isinstance(x, torch.Tensor) else x for x in v]
            out[k] = v
        return out

    def task(self, arguments: dict) -> tuple[Task, list[Tensor], dict]:
        """The Task for these arguments (the last TASKS_KEPT kept by input shapes, dtypes and
        attributes, symbolic sizes by their expressions and values), with the tensor inputs in
        task order and the attributes."""
        tensors, attrs, call, key = [], {}, {}, [self.name]
        for name, v in arguments.items():
            if isinstance(v, Tensor):
                tensors.append(v)
                call[name] = TensorInput(name, v.shape, v.dtype)
                key.append((name, size_key(v.shape), v.dtype.name))
            elif isinstance(v, list) and v and all(isinstance(x, Tensor) for x in v):
                tensors.extend(v)
                call[name] = [TensorInput(f"{name}{k}", x.shape, x.dtype) for k, x in enumerate(v)]
                key.append((name, tuple((size_key(x.shape), x.dtype.name) for x in v)))
            elif isinstance(v, list) and any(isinstance(x, Tensor) for x in v):
                raise OperatorError(f"{self.name}: argument '{name}' mixes tensors and other values")
            else:
                attrs[name] = call[name] = v
                key.append((name, repr(size_key(v))))
        key = tuple(key)
        cached = self._tasks.get(key)
        if cached is None:
            result = self.definition(**call)
            outputs = list(result) if isinstance(result, (tuple, list)) else [result]
            if not outputs or not all(isinstance(o, TensorNode) for o in outputs):
                raise TypeError(f"operator '{self.name}' must return computes, got {result!r}")
            inputs = [t for v in call.values() for t in (v if isinstance(v, list) else [v])
                      if isinstance(t, TensorInput)]
            cached = Task(self.name, inputs, outputs, attrs)
            self._tasks.put(key, cached)
        return cached, tensors, attrs

    def __call__(self, *args, **kwargs):
        args, kwargs = _on_one_device(args, kwargs)
        arguments = self.bind(args, kwargs)
        task, tensors, attrs = self.task(arguments)
        dev = _device_of(self.name, tensors, attrs)
        op = Operator(self, tensors, attrs, task, dev)
        outs = op.outputs
        return outs[0] if len(outs) == 1 else tuple(outs)


def _on_one_device(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The arguments with every CPU tensor whose values are known (a constant, or computed from
    constants while tracing: `torch.tensor(2.0)`, `torch.arange(n)` in a forward) moved to the
    one CUDA device the other tensor arguments are on, as PyTorch combines a CPU scalar with
    CUDA tensors. Symbolic CPU tensors stay where they are (and the operator refuses the mix)."""
    flat = [a for v in (*args, *kwargs.values()) for a in (v if isinstance(v, (list, tuple)) else [v])]
    cuda = {t.device for t in flat if isinstance(t, Tensor) and t.device.is_cuda}
    if len(cuda) != 1 or not any(isinstance(t, Tensor) and not t.device.is_cuda and not t.is_symbolic for t in flat):
        return args, kwargs
    target = next(iter(cuda)).torch()

    def moved(v):
        if isinstance(v, (list, tuple)):
            return type(v)(moved(x) for x in v)
        if isinstance(v, Tensor) and not v.device.is_cuda and not v.is_symbolic:
            return from_torch(v.torch().to(target))
        return v
    return tuple(moved(a) for a in args), {k: moved(v) for k, v in kwargs.items()}


def _device_of(name: str, tensors: list[Tensor], attrs: dict) -> Device:
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise OperatorError(f"{name}: inputs are on different devices ({', '.join(map(str, devices))})")
    if devices:
        return devices.pop()
    return as_device(attrs.get("device") or "cpu")


def operator(name: str, *, display_name: str | None = None, override: bool = False,
             traits: Traits = Traits()):
    """Decorator making a compute definition into an operator definition.

    The result is not registered anywhere: a plugin returns it from its `kiln_operators` hook.
    `override=True` lets it replace another plugin's operator of the same name; `traits`
    declares what the graph passes read of it (`kiln.graph.Traits`).
    """
    def wrap(fn):
        return OperatorDef(name, fn, display_name, override, traits)
    return wrap


class Operator:
    """A node of a graph: an operator applied to input tensors with attributes."""

    def __init__(self, definition: OperatorDef, inputs: list[Tensor], attrs: dict, task: Task,
                 device: Device):
        self.definition = definition
        self.inputs = list(inputs)
        self.attrs = dict(attrs)
        self.task = task
        self.device = device
        generated = all(t.generated for t in inputs)
        if any(t.is_symbolic for t in inputs) or (generated and _recorded_generated(task)):
            self.outputs = [Tensor(o.shape, o.dtype, device, trace=(self, k), generated=generated)
                            for k, o in enumerate(task.outputs)]
        else:
            # not a read of the inputs' values: run_task records how it computed its outputs
            # (kiln.runtime.folds), so a cached plan computes them again from the caller's tensors
            results = run_task(task, device, [t.storage for t in inputs])
            self.outputs = [Tensor(o.shape, o.dtype, device, storage=r, generated=generated)
                            for o, r in zip(task.outputs, results)]

    @property
    def name(self) -> str:
        return self.definition.display_name

    def __repr__(self) -> str:
        return f"<{self.name} operator>"


# (id(task), device, tuning level or None) -> (task, its kernel): the task is held so that its id stays its own
_compiled = Recent(lambda: KERNELS_KEPT)


def compiled_task(task: Task, device: Device, settings: Settings | None = None):
    """The built kernel of `task` on `device` with `settings` (those in effect when None, read
    only to build): the one built before at the same tuning level (`search_space`; or, for
    None, also without settings given) while it is among the KERNELS_KEPT most recently used,
    else built now."""
    key = (id(task), device, None if settings is None else settings.search_space)
    found = _compiled.get(key)
    if found is None:
        found = (task, build_task(task, device, settings))
        _compiled.put(key, found)
    else:
        current_record().add_kernel_reused()
    return found[1]


def run_task(task: Task, device: Device, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Run `task` on `device` with torch tensors; return its outputs, recorded as computed by
    its kernel from `inputs` (`kiln.runtime.folds.record`)."""
    for t, spec in zip(inputs, task.inputs):
        if tuple(t.shape) != spec.shape:
            raise OperatorError(f"{task.name}: input '{spec.name}' has shape {tuple(t.shape)}, "
                                f"the compiled task expects {spec.shape}")
    kernel = compiled_task(task, device)
    if any(isinstance(s, SymSize) for s in getattr(kernel.program, "sizes", ())):
        # the values computed now are those of the traced sizes (C code reads them unseen)
        size_reads.note_read(f"{task.name} computed while tracing, of symbolic sizes")
    outputs = kernel([t.contiguous() for t in inputs])
    folds.record(kernel.program, device, inputs, outputs)
    return outputs
