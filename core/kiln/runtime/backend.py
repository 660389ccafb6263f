"""The runtime backends: one per device kind, chosen by a table lookup on `Device.kind`.

A backend compiles a schedule's program (`kiln.runtime.cpu.CpuProgram`,
`kiln.runtime.cuda.CudaProgram`) through the on-disk kernel cache, loads it, and launches it;
it keeps the loaded kernels in its in-memory cache, once per program and device, for as long as
something uses them (a `CompiledTask`: a step of a CompiledGraph, `kiln.graph.operator`'s
kernels kept for reuse), so that a kernel is never dropped from under its users and one no
longer used does not stay loaded.
"""
from __future__ import annotations

import copy
import threading
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from kiln.device import Device
from kiln.ir.compute import Task
from kiln.runtime import cpu, cuda
from kiln.runtime.plan_binding import bound


class DeviceKernel:
    """A loaded kernel (`kernel`, a backend's: `kernel(inputs, outputs)` with torch tensors) on
    one device; a call whose outputs are all empty launches nothing. `traced` is the program as
    its schedule made it, symbolic sizes as SymSizes (`kiln.runtime.plan_binding`), where it
    was loaded from one."""

    def __init__(self, device: Device, kernel, traced=None):
        self.device = device
        self.kernel = kernel
        self.traced = traced

    @property
    def program(self):
        """The program the kernel was built from (`kiln.runtime.cpu.CpuProgram`, ...): as its
        schedule made it where that is known (`traced`)."""
        return self.kernel.program if self.traced is None else self.traced

    def prepared(self, constants: list[torch.Tensor | None],
                 threads: int | None = None) -> tuple[DeviceKernel, torch.Tensor] | None:
        """Where its kernel lays out one of the inputs that are constants (`constants`: one per
        input, None for the others) once, as `kiln.runtime.cpu.Preparation` says (by `threads`
        threads, the backend's choice by default): a copy of this kernel whose kernel takes the
        prepared form as one more input, and that form. Else None (kernels without
        preparations: every CUDA kernel for now)."""
        prepare = getattr(self.kernel, "prepare", None)
        found = prepare(constants, threads) if prepare else None
        if found is None:
            return None
        kernel = copy.copy(self)
        kernel.kernel, kernel.traced = found[0], None
        return kernel, found[1]

    def __call__(self, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """Run on contiguous `inputs`, writing `outputs`."""
        for o in outputs:
            if o.numel():
                self.kernel(inputs, outputs)
                break
        return outputs


class CompiledTask(DeviceKernel):
    """A loaded kernel computing one Task on one device: call it with torch tensors."""

    def __init__(self, task: Task, device: Device, kernel, traced=None):
        super().__init__(device, kernel, traced)
        self.task = task

    def __call__(self, inputs: list[torch.Tensor], outputs: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Run on contiguous `inputs`, writing `outputs` (allocated when not given)."""
        if outputs is None:
            outputs = [torch.empty(o.shape, dtype=o.dtype.torch_dtype, device=self.device.torch())
                       for o in self.task.outputs]
        return super().__call__(inputs, outputs)


@dataclass(eq=False)
class Backend:
    """The runtime of one device kind.

    `program_type` is the program its schedules produce; `load_kernel(program, device)`
    compiles it (through the on-disk cache) and loads it, returning a kernel called as
    `kernel(inputs, outputs)` with torch tensors; `unavailable()` is None where the backend can
    run here, else the reason it cannot (raised as `error`); `arch(device)` is the device's
    architecture as a number (90 for sm_90, 100 for sm_100), None where templates do not
    depend on one. A loaded kernel stays in the backend's table while it is referenced
    elsewhere, and no longer (the table holds it weakly).

    For saved models (`kiln.save`): `architecture(device)` names what its kernels are built for
    (a saved file records it, and loads only where it is the same), `binary(kernel)` is a
    loaded kernel's built artifact (its bytes and file suffix; None for a program that builds
    nothing), and `from_binary(program, device, path)` loads `program` from such an artifact
    written to `path` without compiling anything (path None: a program that builds nothing; for
    any other, a ValueError).
    """

    kind: str
    program_type: type
    load_kernel: Callable
    unavailable: Callable[[], str | None] = lambda: None
    arch: Callable[[Device], int | None] = lambda device: None
    error: type = RuntimeError
    architecture: Callable[[Device], str] = lambda device: ""
    binary: Callable = lambda kernel: None
    from_binary: Callable = lambda program, device, path: _cannot_load(program)
    _loaded: weakref.WeakValueDictionary = field(default_factory=weakref.WeakValueDictionary)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def load(self, program, device: Device):
        """The loaded kernel of `program` on `device` (its symbolic sizes at their values in its
        trace, `kiln.runtime.plan_binding`): the one already loaded while anything still uses
        it, else compiled (through the on-disk cache) and loaded now."""
        program = bound(program, None)
        if not isinstance(program, self.program_type):
            raise TypeError(f"the {self.kind} runtime runs a {self.program_type.__name__}, got "
                            f"{type(program).__name__}")
        key = (program.key(), device)
        with self._lock:
            found = self._loaded.get(key)
        if found is None:
            found = self.load_kernel(program, device)
            with self._lock:
                found = self._loaded.setdefault(key, found)
        return found

    def check_available(self, what: str) -> None:
        """Raise, saying `what` failed and why, where this backend cannot run here."""
        reason = self.unavailable()
        if reason:
            raise self.error(f"{what}: {self.kind.upper()} is unavailable: {reason}")


BACKENDS: dict[str, Backend] = {
    "cpu": Backend("cpu", cpu.CpuProgram, lambda program, device: cpu.CpuKernel(program),
                   architecture=lambda device: cpu.architecture(),
                   binary=lambda kernel: (Path(kernel.path).read_bytes(), ".so"),
                   from_binary=lambda program, device, path: cpu.CpuKernel(program, _given(path))),
    "cuda": Backend("cuda", cuda.CudaProgram, lambda program, device: cuda.CudaRunner(program, device.index),
                    cuda.unavailable_reason, lambda device: cuda.arch_number(cuda.device_info(device.index)["arch"]),
                    cuda.CudaError, architecture=lambda device: cuda.device_info(device.index)["arch"],
                    binary=lambda kernel: None if kernel.cubin is None else (Path(kernel.cubin).read_bytes(), ".cubin"),
                    from_binary=lambda program, device, path: cuda.CudaRunner(program, device.index, path, build=False)),
}


def _cannot_load(program):
    raise ValueError(f"no runtime loads a saved {type(program).__name__}")


def _given(path: Path | None) -> Path:
    if path is None:
        raise ValueError("no shared object given for a CPU program")
    return path


def backend_for(device: Device) -> Backend:
    """The runtime backend of `device`'s kind."""
    try:
        return BACKENDS[device.kind]
    except KeyError:
        raise ValueError(f"no runtime backend for device {device}: Kiln runs on "
                         f"{', '.join(BACKENDS)}") from None
