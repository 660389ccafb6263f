"""A CompiledGraph as data: what the whole-graph cache stores and `kiln.save` writes.

A `Plan` holds, for each step, its kernel's program and device (what identifies the kernel:
`load_kernels` loads each through its backend, so through the on-disk kernel cache), the
buffer slots the step reads and writes, and the graph's buffers, inputs, outputs and
constants, as they were before any constant was laid out for its kernel
(`kiln.runtime.cpu.Preparation`). `assemble` makes the CompiledGraph: it prepares those
constants again, from the tensors the plan holds then, so a plan whose constants are replaced
by other tensors of the same shapes (the caller's parameters, in another process) prepares
theirs.

`dumps` and `loads` write and read plans (and plain records holding them) as
`kiln.runtime.serialize` does: tensors as raw bytes, read back building tensors, plain
containers and the runtime's own data classes only, nothing that runs code while it is read.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Sequence

import torch

from kiln.device import Device
from kiln.dtypes import DataType
from kiln.runtime.backend import DeviceKernel, backend_for
from kiln.runtime.compiled_graph import Buffer, CompiledGraph, Step, View, ViewKernel
from kiln.runtime.cpu import CpuProgram, Preparation
from kiln.runtime.cuda import CudaProgram, Launch, TensorMapArg
from kiln.runtime import serialize
from kiln.runtime.kernel_errors import KernelCheck
from kiln.runtime.plan_binding import bound
from kiln.runtime.threads import threads_for


@dataclass
class Plan:
    """Steps over numbered buffer slots, each of a program on a device (see the module's
    docstring): `kernels[k]` is step k's (program, device) and `steps[k]` its (input slots,
    output slots); `constants` maps slots to fixed tensors."""

    kernels: list[tuple[object, Device]]
    steps: list[tuple[tuple[int, ...], tuple[int, ...]]]
    buffers: list[Buffer]
    inputs: list[int]
    outputs: list[int]
    constants: dict[int, torch.Tensor]

    def load_kernels(self) -> list[DeviceKernel]:
        """Each step's kernel, loaded by its device's backend (through the kernel cache); a
        `View` step's runs nothing."""
        return [DeviceKernel(device, ViewKernel() if isinstance(program, View) else backend_for(device).load(program, device))
                for program, device in self.kernels]

    def assemble(self, kernels: Sequence[DeviceKernel] | None = None) -> CompiledGraph:
        """The CompiledGraph running `kernels` (one per step, the plan's own by default, see
        `load_kernels`), each constant a kernel lays out once prepared now for it (one more
        constant slot that the step reads; several prepared at once, see `_each_prepared`)."""
        kernels = self.load_kernels() if kernels is None else kernels
        # a plan traced at symbolic sizes runs at the sizes of its trace (`kiln.runtime.plan_binding`)
        buffers = [Buffer(tuple(map(int.__int__, b.shape)), b.dtype, b.device) for b in self.buffers]
        constants, steps = dict(self.constants), []
        found = _each_prepared(kernels, [[self.constants.get(s) for s in ins] for ins, _ in self.steps])
        for kernel, (ins, outs), prepared in zip(kernels, self.steps, found):
            if prepared is not None:
                kernel, form = prepared
                constants[len(buffers)] = form
                ins = (*ins, len(buffers))
                buffers.append(Buffer(tuple(form.shape), form.dtype, form.device))
            steps.append(Step(kernel, tuple(ins), tuple(outs)))
        return CompiledGraph(steps, buffers, self.inputs, self.outputs, constants, plan=self)


def _each_prepared(kernels: Sequence[DeviceKernel], constants: list[list[torch.Tensor | None]]) -> list:
    """`kernel.prepared(its constants)` for each kernel; where the constants to prepare hold
    enough bytes (`kiln.runtime.threads`), several at once on torch's number of threads, each by one
    thread: one is a copy of some megabytes, less than what a parallel region costs where the
    threads must wait for cores (a machine busy with other work). A step reading a constant
    that an earlier step reads too is prepared after the others, in the calling thread, so that
    it finds a form laid out already for the same kernel instead of laying out its own at the
    same time."""
    workers = threads_for(len(kernels), _preparing_bytes(kernels, constants))
    if workers <= 1:
        return [kernel.prepared(step) for kernel, step in zip(kernels, constants)]
    # one OpenMP thread in the pool's threads alone: the setting is the calling thread's, and
    # torch's number of threads is the caller's
    prepare = lambda k: kernels[k].prepared(constants[k], threads=1)
    seen, first, later = set(), [], []
    for k, step in enumerate(constants):
        read = {id(c) for c in step if c is not None}
        (later if read & seen else first).append(k)
        seen |= read
    with ThreadPoolExecutor(workers) as pool:
        found = dict(zip(first, pool.map(prepare, first)))
    found.update((k, kernels[k].prepared(constants[k])) for k in later)
    return [found[k] for k in range(len(kernels))]


def _preparing_bytes(kernels: Sequence[DeviceKernel], constants: list[list[torch.Tensor | None]]) -> int:
    """The bytes of the constants that the kernels' preparations lay out."""
    found = [(getattr(getattr(kernel.kernel, "program", None), "preparation", None), step)
             for kernel, step in zip(kernels, constants)]
    return sum(step[p.input].nbytes for p, step in found if p is not None and step[p.input] is not None)


SAFE_CLASSES = (Plan, Buffer, Device, DataType, CpuProgram, Preparation, KernelCheck,
                CudaProgram, Launch, TensorMapArg, View)
"""The classes a serialized plan may hold besides tensors and plain Python values."""


def dumps(record) -> bytes:
    """`record` (a Plan, or plain containers holding plans, tensors and plain values) as bytes
    (`kiln.runtime.serialize`: its tensors as raw bytes), symbolic sizes as their values in the
    trace (`kiln.runtime.plan_binding`)."""
    return serialize.dumps(bound(record, None))


def loads(data, classes: Sequence[type] = ()):
    """The record `dumps` wrote into `data` (bytes, or any buffer): besides tensors, torch's
    dtypes and devices and plain values it builds only instances of SAFE_CLASSES and of
    `classes` (pickle.UnpicklingError for anything else)."""
    return serialize.loads(data, (*SAFE_CLASSES, *classes))
