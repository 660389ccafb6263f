"""The kernel of an in-place update: rows computed before, stored at their places in a buffer.

A graph that writes a few elements into one of its inputs (a KV cache written at the decoding
position, `kiln.passes.in_place`) computes the new elements and their flat offsets in the
input with an ordinary kernel, then runs this one: a task marked with the attribute
STORES_ROWS, whose inputs are the updated buffer `x`, the new elements `rows` and their offsets
`where` (int64, one per element of `rows`, checked in range by the kernel that computed them),
and whose one output is `x` itself (the compiled graph binds the same buffer to both). The
kernel copies `rows[i]` to `x.flat[where[i]]` for each i, element by element as raw bytes of
the element's size, and touches nothing else of `x`: it writes and reads O(rows) bytes,
whatever the size of `x`. Where two offsets are equal the later element wins on the CPU (a
sequential loop); on a GPU which one wins is not fixed.

The task's own compute (what the operator of the graph layer defines) is the same update
written as an output-side gather, for completeness; this kernel is what runs.
"""
from __future__ import annotations

import math

from kiln.codegen.emitter import KernelArgs
from kiln.ir.compute import Task
from kiln.runtime.cpu import CpuProgram
from kiln.runtime.cuda import CudaProgram, Launch

STORES_ROWS = "stores_rows"
"""The task attribute (set True) that marks the store of an in-place update."""

THREADS = 256

_C_TYPES = {1: "uint8_t", 2: "uint16_t", 4: "uint32_t", 8: "uint64_t"}
_CUDA_TYPES = {1: "unsigned char", 2: "unsigned short", 4: "unsigned int", 8: "unsigned long long"}

_C_SOURCE = """#include <stdint.h>
void kiln_store_rows(const {t}* {rows}, const int64_t* {offsets}, {t}* {out}) {{
    for (int64_t i = 0; i < {n}; ++i) {out}[{offsets}[i]] = {rows}[i];
}}
"""

_CUDA_SOURCE = """extern "C" __global__ void __launch_bounds__({threads}) kiln_store_rows(
        const {t}* __restrict__ {rows}, const long long* __restrict__ {offsets}, {t}* {out}) {{
    for (long long i = (long long)blockIdx.x * {threads} + threadIdx.x; i < {n}LL;
         i += (long long)gridDim.x * {threads})
        {out}[{offsets}[i]] = {rows}[i];
}}
"""


def stores_rows(task: Task) -> bool:
    """Whether `task` is the store of an in-place update (see the module's docstring)."""
    return task.attrs.get(STORES_ROWS) is True


def store_program(task: Task, kind: str) -> CpuProgram | CudaProgram:
    """The program storing `task`'s rows into its buffer on a device of `kind` ('cpu', 'cuda')."""
    x, rows, where = task.inputs
    n = math.prod(rows.shape)
    size = x.dtype.nbytes
    names = {"rows": KernelArgs.input(1), "offsets": KernelArgs.input(2), "out": KernelArgs.output(0), "n": n}
    args = (KernelArgs.input(1), KernelArgs.input(2), KernelArgs.output(0))
    if kind == "cpu":
        return CpuProgram(_C_SOURCE.format(t=_C_TYPES[size], **names), "kiln_store_rows", args)
    if kind == "cuda":
        source = _CUDA_SOURCE.format(t=_CUDA_TYPES[size], threads=THREADS, **names)
        return CudaProgram(source, [Launch("kiln_store_rows", args, (THREADS, 1, 1), items=n, per_block=THREADS)])
    raise ValueError(f"no store of in-place updates for devices of kind {kind!r}")
