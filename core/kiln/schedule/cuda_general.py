"""The auto-scheduler's general rule: any task of injective and reduction computes.

Each materialized compute of the task becomes one kernel (`kiln.schedule.cuda_kernels.
buffer_kernel`), launched in order, except that consecutive injective computes none of which
reads another (a rotary embedding's rotated rows and the cache positions they go to) share one
(`injective_kernel`); temporaries come from PyTorch's allocator.
"""
from __future__ import annotations

from kiln.ir.compute import Compute
from kiln.ir.expr import Load, top_reduces, walk
from kiln.ir.inline import Lowered
from kiln.ir.size import SymSize
from kiln.runtime.cuda import CudaProgram
from kiln.codegen.emitter import numel
from kiln.schedule.cuda_kernels import AutoProgram


def _joins(group: list[Compute], buf: Compute, auto: AutoProgram) -> bool:
    """Whether `buf` can be written by the kernel of `group`: all of them injective, `buf`
    reading none of the group, and their sizes plain ints or one symbolic size."""
    if not group or any(top_reduces(b.value) for b in (*group, buf)):
        return False
    ids = {id(b) for b in group}
    if any(isinstance(x, Load) and id(x.tensor) in ids for x in walk(buf.value)):
        return False
    counts = [numel(b.shape) for b in (*group, buf)]
    return not any(isinstance(c, SymSize) for c in counts) or len({auto.sizes.text(c) for c in counts}) == 1


def _write(auto: AutoProgram, n: int, group: list[Compute]) -> None:
    """The kernel of `group`, the task's n-th buffer and those after it."""
    if len(group) > 1:
        auto.write_together(n, group)
    elif group:
        auto.write(n, group[0])


def schedule(lowered: Lowered) -> CudaProgram:
    """The kernels of `lowered`'s materialized buffers (it takes every task)."""
    auto = AutoProgram(lowered)
    group: list[Compute] = []
    first = 0
    for n, buf in enumerate(lowered.buffers):
        if not numel(buf.shape):
            continue
        if _joins(group, buf, auto):
            group.append(buf)
        else:
            _write(auto, first, group)
            group, first = [buf], n
    _write(auto, first, group)
    return auto.program()
