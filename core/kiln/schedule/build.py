"""Building a Task for a device, with an in-memory cache of built kernels."""
from __future__ import annotations

import os
import threading

import torch

from kiln.device import Device
from kiln.ir.compute import Task
from kiln.runtime.cache import content_key

_lock = threading.Lock()
_built: dict[tuple, "CompiledTask"] = {}


class CompiledTask:
    """A built kernel for one Task on one device: call it with torch tensors."""

    def __init__(self, task: Task, device: Device, kernel, launch):
        self.task = task
        self.device = device
        self.kernel = kernel
        self._launch = launch

    def __call__(self, inputs: list[torch.Tensor], outputs: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Run on contiguous `inputs`, writing `outputs` (allocated when not given)."""
        if outputs is None:
            outputs = [torch.empty(o.shape, dtype=o.dtype.torch_dtype, device=self.device.torch())
                       for o in self.task.outputs]
        if any(o.numel() > 0 for o in outputs):
            self._launch(self.kernel, inputs, outputs)
        return outputs


def _cpu_launch(kernel, inputs, outputs):
    kernel(*[t.data_ptr() for t in inputs], *[t.data_ptr() for t in outputs])


def build_task(task: Task, device: Device) -> CompiledTask:
    """The kernel computing `task` on `device` (built once per source and device)."""
    if device.kind == "cpu":
        if os.environ.get("KILN_NVRTC_CHECK"):
            from kiln.schedule.cuda import check_nvrtc
            check_nvrtc(task, os.environ["KILN_NVRTC_CHECK"].split(","))
        from kiln.runtime.cpu import CpuKernel
        from kiln.schedule.cpu_auto import schedule_cpu
        source, nargs, checks = schedule_cpu(task)
        key = ("cpu", content_key(source), tuple(checks))   # the messages are not in the source
        with _lock:
            found = _built.get(key)
        if found is None:
            found = CompiledTask(task, device, CpuKernel(source, "kiln_kernel", nargs, checks), _cpu_launch)
            with _lock:
                _built[key] = found
        return CompiledTask(task, device, found.kernel, _cpu_launch)
    if device.kind == "cuda":
        from kiln.schedule.cuda import build_cuda_task
        return build_cuda_task(task, device)
    raise ValueError(f"no backend for device {device}")
