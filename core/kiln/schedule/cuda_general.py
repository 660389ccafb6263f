"""The auto-scheduler's general rule: any task of injective and reduction computes.

Each materialized compute of the task becomes one kernel (`kiln.schedule.cuda_kernels.
buffer_kernel`), launched in order; temporaries come from PyTorch's allocator.
"""
from __future__ import annotations

from kiln.ir.inline import Lowered
from kiln.runtime.cuda import CudaProgram
from kiln.codegen.emitter import numel
from kiln.schedule.cuda_kernels import AutoProgram


def schedule(lowered: Lowered) -> CudaProgram:
    """One kernel per materialized buffer of `lowered` (it takes every task)."""
    auto = AutoProgram(lowered)
    for n, buf in enumerate(lowered.buffers):
        if numel(buf.shape):
            auto.write(n, buf)
    return auto.program()
