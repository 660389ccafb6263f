"""The CPU auto-scheduler's rule: any task of injective and reduction computes, as C with OpenMP.

Each materialized compute (see `kiln.ir.inline`) becomes one loop nest. An injective compute
loops over its outer dimensions in parallel and over its last dimension innermost, so the C
compiler can vectorize it; a compute that reduces loops over its elements in parallel, each
element running its reduction loop.
"""
from __future__ import annotations

from kiln.codegen.c import CDialect
from kiln.codegen.emitter import Emitter, KernelArgs, numel, row_major_strides
from kiln.ir.compute import Compute
from kiln.ir.expr import Var
from kiln.ir.inline import Lowered, substitute
from kiln.ir.simplify import simplify
from kiln.runtime.cpu import CpuProgram

PARALLEL_THRESHOLD = 1 << 15


def _loop_nest(em: Emitter, buf: Compute, name: str) -> None:
    """Emit the loops writing every element of `buf` to the C array `name`."""
    shape = buf.shape
    items = numel(shape)
    if items == 0:
        return
    heavy = buf.has_reduce
    last = 1 if (heavy or not shape) else shape[-1]
    outer = items // last
    o, il = Var("o", outer), Var("il", last)
    flat = o * last + il if last > 1 else o
    index, stride = {}, 1
    outer_axes = list(zip(buf.axes, shape))
    if last > 1:
        index[id(buf.axes[-1])] = il
        outer_axes = outer_axes[:-1]
    for axis, size in reversed(outer_axes):
        index[id(axis)] = simplify((o // stride) % size)
        stride *= size
    value = simplify(substitute(buf.value, index))
    work = items * (16 if heavy else 1)
    pragma = f"#pragma omp parallel for schedule(static) if({work} > {PARALLEL_THRESHOLD})"
    if outer > 1 or last == 1:
        em.line(pragma)
        em.names[id(o)] = "o"
        em.open(f"for (int64_t o = 0; o < {outer}; ++o)")
    else:
        em.names[id(o)] = "0"
    if last > 1:
        if outer == 1:
            em.line(pragma)
        em.names[id(il)] = "il"
        em.open(f"for (int64_t il = 0; il < {last}; ++il)")
    v = em.emit(value)
    em.line(f"{name}[{em.emit(simplify(flat))}] = {em.dialect.store(buf.dtype, v)};")
    for _ in range(int(outer > 1 or last == 1) + int(last > 1)):
        em.close()


def render_cpu(lowered: Lowered, kernel_name: str) -> str:
    """C source of one function `kernel_name(inputs..., outputs...)` computing the task."""
    d = CDialect()
    temps = lowered.temporaries
    names = KernelArgs.names(lowered.inputs, lowered.outputs, temps)
    params = KernelArgs.params(d, lowered.inputs, lowered.outputs)
    strides = {id(t): row_major_strides(t.shape) for t in lowered.inputs + lowered.buffers}
    em = Emitter(d, names, strides)
    for t in temps:
        em.line(f"{d.storage_type(t.dtype)}* {names[id(t)]} = ({d.storage_type(t.dtype)}*)malloc("
                f"{max(numel(t.shape), 1)} * sizeof({d.storage_type(t.dtype)}));")
    for buf in lowered.buffers:
        _loop_nest(em, buf, names[id(buf)])
    for t in temps:
        em.line(f"free({names[id(t)]});")
    body = "\n".join(em.lines)
    return f"{d.prelude}\nvoid {kernel_name}({', '.join(params)}) {{\n{body}\n}}\n"


def schedule(lowered: Lowered) -> CpuProgram:
    """The CPU program of `lowered` (it takes every task)."""
    args = KernelArgs.args(len(lowered.inputs), len(lowered.outputs))
    return CpuProgram(render_cpu(lowered, "kiln_kernel"), "kiln_kernel", tuple(args))
