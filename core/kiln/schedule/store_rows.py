"""The kernel of in-place updates: rows computed before, stored at their places in buffers.

A graph that writes a few elements into one of its inputs (a KV cache written at the decoding
position, `kiln.passes.in_place`) computes the new elements and their flat offsets in the
input with an ordinary kernel, then runs this one: a task marked with the attribute
STORES_ROWS, whose inputs are the updated buffers `xs`, the new elements `rows` and their
offsets `wheres` (int64, one per element of its rows, checked in range by the kernel that
computed them), one of each per updated input, and whose outputs are the `xs` themselves (the
compiled graph binds the same buffers to both). The kernel copies `rows[k][i]` to
`xs[k].flat[wheres[k][i]]` for each k and i, element by element as raw bytes of the element's
size, and touches nothing else of the buffers: it writes and reads O(rows) bytes, whatever
their sizes; one launch stores every update of the task. Where two offsets into one buffer
are equal the later element wins on the CPU (a sequential loop); on a GPU which one wins is
not fixed.

The task's own compute (what the operator of the graph layer defines) is the same update
written as an output-side gather, for completeness; this kernel is what runs.

A kernel that computes the rows and offsets may store them itself instead (a task's row
stores, `kiln.ir.row_stores`): `row_store` is the statement that copies one element, which the
auto-scheduler's general rules write once both of a store's buffers hold it (`stores_after`).
"""
from __future__ import annotations

import math

from kiln.codegen.emitter import KernelArgs
from kiln.ir.compute import Compute, Task
from kiln.ir.inline import Lowered
from kiln.ir.row_stores import RowStore
from kiln.runtime.cpu import CpuProgram
from kiln.runtime.cuda import CudaProgram, Launch

STORES_ROWS = "stores_rows"
"""The task attribute (set True) that marks the store of an in-place update."""

THREADS = 256

_C_TYPES = {1: "uint8_t", 2: "uint16_t", 4: "uint32_t", 8: "uint64_t"}
_CUDA_TYPES = {1: "unsigned char", 2: "unsigned short", 4: "unsigned int", 8: "unsigned long long"}

_C_STORE = "    for (int64_t i = 0; i < {n}; ++i) (({t}*){out})[{offsets}[i]] = ((const {t}*){rows})[i];\n"
_C_SOURCE = """#include <stdint.h>
void kiln_store_rows({params}) {{
{body}}}
"""

_CUDA_STORE = """        if (i < {end}LL) {{ (({t}*){out})[{offsets}[i - {start}LL]] = ((const {t}*){rows})[i - {start}LL]; continue; }}
"""
_CUDA_SOURCE = """extern "C" __global__ void __launch_bounds__({threads}) kiln_store_rows({params}) {{
    for (long long i = (long long)blockIdx.x * {threads} + threadIdx.x; i < {n}LL;
         i += (long long)gridDim.x * {threads}) {{
{body}    }}
}}
"""


def stores_rows(task: Task) -> bool:
    """Whether `task` is the store of in-place updates (see the module's docstring)."""
    return task.attrs.get(STORES_ROWS) is True


def store_program(task: Task, kind: str) -> CpuProgram | CudaProgram:
    """The program storing `task`'s rows into its buffers on a device of `kind` ('cpu', 'cuda')."""
    count = len(task.outputs)
    xs, rows, wheres = (task.inputs[k * count:(k + 1) * count] for k in range(3))
    sizes = [math.prod(r.shape) for r in rows]
    stores = [dict(rows=KernelArgs.input(count + k), offsets=KernelArgs.input(2 * count + k), out=KernelArgs.output(k),
                   size=x.dtype.nbytes, n=n, start=sum(sizes[:k]), end=sum(sizes[:k + 1]))
              for k, (x, n) in enumerate(zip(xs, sizes))]
    args = tuple(KernelArgs.input(count + k) for k in range(2 * count)) + tuple(KernelArgs.output(k) for k in range(count))
    if kind == "cpu":
        params = ", ".join([f"const void* {s['rows']}" for s in stores] + [f"const int64_t* {s['offsets']}" for s in stores]
                           + [f"void* {s['out']}" for s in stores])
        body = "".join(_C_STORE.format(t=_C_TYPES[s["size"]], **s) for s in stores)
        return CpuProgram(_C_SOURCE.format(params=params, body=body), "kiln_store_rows", args)
    if kind == "cuda":
        params = ", ".join([f"const void* __restrict__ {s['rows']}" for s in stores]
                           + [f"const long long* __restrict__ {s['offsets']}" for s in stores]
                           + [f"void* {s['out']}" for s in stores])
        body = "".join(_CUDA_STORE.format(t=_CUDA_TYPES[s["size"]], **s) for s in stores)
        source = _CUDA_SOURCE.format(threads=THREADS, n=sum(sizes), params=params, body=body)
        return CudaProgram(source, [Launch("kiln_store_rows", args, (THREADS, 1, 1), items=sum(sizes), per_block=THREADS)])
    raise ValueError(f"no store of in-place updates for devices of kind {kind!r}")


def stores_after(lowered: Lowered, buf: Compute) -> list[RowStore]:
    """The row stores of `lowered` (`kiln.ir.row_stores`) whose rows and offsets are both
    written once its buffer `buf` is: `buf` is the later of the two in `lowered.buffers`."""
    if not lowered.stores:
        return []
    position = {id(b): k for k, b in enumerate(lowered.buffers)}
    return [s for s in lowered.stores
            if max(position[id(lowered.outputs[s.rows])], position[id(lowered.outputs[s.offsets])]) == position[id(buf)]]


def row_store(lowered: Lowered, store: RowStore, names: dict[int, str], index: str) -> str:
    """The C statement copying element `index` (a C expression) of `store`'s rows to its offset
    in its output's buffer, each named by `names` (by tensor id), as raw elements: the rows
    have the output's dtype."""
    rows, offsets, out = (names[id(lowered.outputs[k])] for k in (store.rows, store.offsets, store.output))
    return f"{out}[{offsets}[{index}]] = {rows}[{index}];"
