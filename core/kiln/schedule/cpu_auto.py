"""The CPU auto-scheduler: any task of injective and reduction computes, as C with OpenMP.

Each materialized compute (see `kiln.ir.inline`) becomes one loop nest. An injective compute
loops over its outer dimensions in parallel and over its last dimension innermost, so the C
compiler can vectorize it; a compute that reduces loops over its elements in parallel, each
element running its reduction loop.
"""
from __future__ import annotations

from kiln.codegen.c import CDialect
from kiln.codegen.emitter import Emitter, row_major_strides
from kiln.ir.compute import Compute
from kiln.ir.expr import Var
from kiln.ir.inline import Lowered, inline_task, substitute
from kiln.ir.simplify import simplify
from kiln.runtime.kernel_errors import KernelCheck

PARALLEL_THRESHOLD = 1 << 15


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _loop_nest(em: Emitter, buf: Compute, name: str) -> None:
    """Emit the loops writing every element of `buf` to the C array `name`."""
    shape = buf.shape
    numel = _numel(shape)
    if numel == 0:
        return
    heavy = buf.has_reduce
    last = 1 if (heavy or not shape) else shape[-1]
    outer = numel // last
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
    work = numel * (16 if heavy else 1)
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


def render_cpu(lowered: Lowered, kernel_name: str) -> tuple[str, list[KernelCheck]]:
    """C source of one function `kernel_name(inputs..., outputs..., status)` computing the
    task, and the checks whose codes it may write to `status` (see `kiln.runtime.kernel_errors`)."""
    d = CDialect()
    names, strides, params = {}, {}, []
    for k, t in enumerate(lowered.inputs):
        names[id(t)] = f"in{k}"
        params.append(f"const {d.storage_type(t.dtype)}* __restrict__ in{k}")
    for k, t in enumerate(lowered.outputs):
        names[id(t)] = f"out{k}"
        params.append(f"{d.storage_type(t.dtype)}* __restrict__ out{k}")
    params.append("int64_t* __restrict__ kiln_status")
    temps = lowered.temporaries
    for k, t in enumerate(temps):
        names[id(t)] = f"tmp{k}"
    for t in lowered.inputs + lowered.buffers:
        strides[id(t)] = row_major_strides(t.shape)
    em = Emitter(d, names, strides)
    for k, t in enumerate(temps):
        em.line(f"{d.storage_type(t.dtype)}* tmp{k} = ({d.storage_type(t.dtype)}*)malloc("
                f"{max(_numel(t.shape), 1)} * sizeof({d.storage_type(t.dtype)}));")
    for buf in lowered.buffers:
        _loop_nest(em, buf, names[id(buf)])
    for k in range(len(temps)):
        em.line(f"free(tmp{k});")
    body = "\n".join(em.lines)
    checks = [KernelCheck(c.error, c.message) for c in em.checks]
    return f"{d.prelude}\nvoid {kernel_name}({', '.join(params)}) {{\n{body}\n}}\n", checks


def schedule_cpu(task) -> tuple[str, int, list[KernelCheck]]:
    """(C source, number of tensor pointer arguments, checks) for `task`; the kernel takes a
    status buffer after its tensors."""
    lowered = inline_task(task)
    source, checks = render_cpu(lowered, "kiln_kernel")
    return source, len(lowered.inputs) + len(lowered.outputs), checks
