"""Scheduling and building a Task for a CUDA GPU.

The templates that plugins contribute for the task's operator (target 'cuda') are tried by
priority; the first that applies renders the program, with knobs the tuner picks at the
tuning level `$KILN_TUNE_LEVEL` (0 by default: the template's default knobs). Any other task
goes to the auto-scheduler (`kiln.schedule.cuda_auto`).
"""
from __future__ import annotations

import os
import threading

import torch

from kiln.device import Device
from kiln.ir.compute import Task
from kiln.runtime import cuda as rt
from kiln.runtime.tensor_map import resolve
from kiln.schedule.cuda_auto import schedule_cuda
from kiln.schedule.cuda_program import CudaProgram
from kiln.schedule.template import Template

_lock = threading.Lock()
_loaded: dict[tuple, "CudaRunner"] = {}


def tune_level() -> int:
    """The tuning level: $KILN_TUNE_LEVEL (0, 1 or 2), 0 by default."""
    level = os.environ.get("KILN_TUNE_LEVEL", "0")
    if level not in ("0", "1", "2"):
        raise ValueError(f"KILN_TUNE_LEVEL must be 0, 1 or 2, got {level!r}")
    return int(level)


def cuda_templates(task: Task, arch: int | None = None) -> list[Template]:
    """The CUDA templates that apply to `task` (on a GPU of architecture `arch`, e.g. 90, when
    given), highest priority first."""
    from kiln.plugins.registry import registry
    found = [t for t in registry().items("schedules")
             if isinstance(t, Template) and t.target == "cuda" and task.name in t.operators
             and (arch is None or t.min_arch <= arch) and t.applies(task)]
    return sorted(found, key=lambda t: -t.priority)


def candidate_programs(task: Task, level: int = 0, sm_count: int = 132) -> list[tuple[str, dict, CudaProgram]]:
    """Every program Kiln may build for `task` at a tuning level: (template name, knobs,
    program) for each knob setting the tuner tries (`kiln.schedule.tuner.candidates`, for a GPU
    of `sm_count` multiprocessors: an H100/H200 by default) of each applicable template, and the
    auto-scheduler's."""
    from kiln.schedule.tuner import candidates
    out = [(t.name, knobs, t.render(task, **knobs)) for t in cuda_templates(task)
           for knobs in candidates(t, task, sm_count, level)]
    return out + [("auto", {}, schedule_cuda(task))]


def arch_for(program: CudaProgram, device_arch: str) -> str:
    """The NVRTC architecture to build `program` for on a device of `device_arch` ('sm_90')."""
    return device_arch + program.arch_suffix


class CudaRunner:
    """A built CudaProgram on one device: call with input and output tensors."""

    def __init__(self, program: CudaProgram, device: Device):
        info = rt.device_info(device.index)
        self.program = program
        self.device = device
        self.sm_count = info["sm_count"]
        cubin = rt.compile_cubin(program.source, program.kernel_names[0], arch_for(program, info["arch"]))
        smem = {}
        for launch in program.launches:
            smem[launch.kernel] = max(smem.get(launch.kernel, 0), launch.smem)
        self.kernels = {name: rt.CudaKernel(cubin, name, device.index, smem[name]) for name in program.kernel_names}

    def __call__(self, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> None:
        align = self.program.alignment
        if align > 1 and any(t.data_ptr() % align for t in outputs):
            staged = [torch.empty_like(t) for t in outputs]
            self(inputs, staged)
            for dst, src in zip(outputs, staged):
                dst.copy_(src)
            return
        inputs = [t.clone() if t.data_ptr() % align else t for t in inputs]
        buffers = {f"in{k}": t.data_ptr() for k, t in enumerate(inputs)}
        buffers.update({f"out{k}": t.data_ptr() for k, t in enumerate(outputs)})
        temps = [torch.empty(shape, dtype=t.torch_dtype, device=self.device.torch())
                 for shape, t in self.program.temporaries]
        buffers.update({f"tmp{k}": t.data_ptr() for k, t in enumerate(temps)})
        stream = torch.cuda.current_stream(self.device.index).cuda_stream
        for launch in self.program.launches:
            self.kernels[launch.kernel].launch([resolve(a, buffers) for a in launch.args], launch.grid_for(self.sm_count),
                                               launch.block, launch.smem, stream)


def load_program(program: CudaProgram, device: Device) -> CudaRunner:
    """Compile (through the kernel cache) and load `program` on `device`, once per process."""
    key = (program.source, tuple(program.launches), device)
    with _lock:
        found = _loaded.get(key)
    if found is None:
        found = CudaRunner(program, device)
        with _lock:
            _loaded[key] = found
    return found


def select_program(task: Task, device: Device) -> CudaProgram:
    """The program to run `task` with: the best applicable template's, tuned, or the auto-scheduler's."""
    templates = cuda_templates(task, int(rt.device_info(device.index)["arch"][3:5]))
    if not templates:
        return schedule_cuda(task)
    template = templates[0]
    from kiln.schedule.tuner import tune
    knobs = tune(task, template, device, tune_level())
    return template.render(task, **knobs)


def build_cuda_task(task: Task, device: Device):
    """The CompiledTask running `task` on the CUDA `device`."""
    from kiln.schedule.build import CompiledTask
    reason = rt.unavailable_reason()
    if reason:
        raise rt.CudaError(f"cannot run '{task.name}' on {device}: CUDA is unavailable: {reason}")
    runner = load_program(select_program(task, device), device)
    return CompiledTask(task, device, runner, lambda kernel, inputs, outputs: kernel(inputs, outputs))


def check_nvrtc(task: Task, archs) -> None:
    """Compile every CUDA program Kiln may build for `task` (tuning level 1) for each of
    `archs` with NVRTC; raises CudaBuildError on the first that fails. Needs no GPU."""
    programs = candidate_programs(task, level=1)
    rt.compile_many([(p.source, f"{task.name}_{name}", arch_for(p, arch.strip()))
                     for name, _, p in programs for arch in archs if p.min_arch <= int(arch.strip()[3:5])])
