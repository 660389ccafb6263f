"""The CPU auto-scheduler's row rule: row tasks (see `kiln.schedule.rows`) as one loop over rows.

Softmax, log_softmax, layer_norm, RMSNorm and the injective operators fused around them: the
rows are split across OpenMP threads; each row computes its statistics once, into locals (a
reduction loop each, sums cascaded as in `kiln.schedule.cpu_auto`), then what of the output is
the same for the whole row (a division by a statistic becomes a multiplication by its
reciprocal), then writes its elements in an inner loop over the row that the C compiler
vectorizes. A statistic that is an output of the task too (a layer norm's mean and rstd, saved
for the backward) is written once a row, as soon as it is known. Costly values that a
statistic computes for each element and the output needs again (softmax's exp(x - max)) are
kept in an array on the thread's stack (rows of up to KEEP_BYTES), not computed twice. No temporary is allocated and the row is read while it is
still in cache. Symbolic sizes are kernel arguments (`kiln.codegen.sizes`).
"""
from __future__ import annotations

from kiln.codegen.c import CDialect
from kiln.codegen.emitter import KernelArgs, numel, row_major_strides
from kiln.codegen.sizes import SizeArgs
from kiln.ir.compute import Compute
from kiln.ir.expr import Const, Expr, Load, Var
from kiln.ir.inline import Lowered
from kiln.runtime.cpu import CpuProgram
from kiln.runtime.kernel_errors import KernelCheck
from kiln.schedule.cpu_auto import PARALLEL_THRESHOLD, CpuEmitter
from kiln.schedule.rows import reciprocals, row_form, row_task, row_uniform_parts, shared_parts

FEW_ROWS = 8            # fewer rows than this leave threads idle in a loop over rows
KEEP_BYTES = 32 << 10   # a thread's stack may hold this much of values kept for the output


class RowEmitter(CpuEmitter):
    """The C emitter of a row kernel: values in `kept` (by key: costly parts of the output
    that the statistics compute for each element too) are stored to their row arrays where
    the statistics compute them, and read back from there by the output (`reuse`)."""

    def __init__(self, dialect, names, strides, e: Var, kept: dict, sizes: SizeArgs):
        super().__init__(dialect, names, strides, sizes=sizes)
        self.e, self.kept = e, kept
        self.reuse = False

    def emit(self, x: Expr) -> str:
        array = None if isinstance(x, (Const, Var)) else self.kept.get(x.key())
        if array is None or self._lookup(x.key()) is not None:
            return super().emit(x)
        position = self.names[id(self.e)]
        if self.reuse:
            return self.let(x.dtype, f"{array}[{position}]", x.key())
        value = super().emit(x)
        self.line(f"{array}[{position}] = {value};")
        return value


def render_rows(lowered: Lowered, out: Compute, p: int, kernel_name: str) -> tuple[str, list[KernelCheck], SizeArgs]:
    """C source of the function `kernel_name(inputs..., outputs..., status, sizes...)` computing
    the row task `lowered` of row output `out` and prefix `p`, the checks whose codes it may
    write to `status` and its symbolic sizes."""
    d = CDialect()
    form = row_form(lowered, out, p)
    names = KernelArgs.names(lowered.inputs, lowered.outputs)
    strides = {id(t): row_major_strides(t.shape) for t in lowered.inputs}
    params = KernelArgs.params(d, lowered.inputs, lowered.outputs) + [f"int64_t* __restrict__ {KernelArgs.STATUS}"]
    names[id(form.o)] = "o"
    result = reciprocals(form.result, form.e)
    kept = shared_parts(form.stats, result, form.e)[:KEEP_BYTES // (4 * form.row_len)]
    sizes = SizeArgs()
    em = RowEmitter(d, names, strides, form.e, {part.key(): f"kiln_kept{k}" for k, part in enumerate(kept)}, sizes)
    work = form.rows * form.row_len * (len(form.stats) + 1)
    row_len = em.size(form.row_len)
    em.line(f"#pragma omp parallel for schedule(static) if({em.size(work)} > {PARALLEL_THRESHOLD})")
    em.open(f"for (int64_t o = 0; o < {em.size(form.rows)}; ++o)")
    for k, part in enumerate(kept):
        em.line(f"{d.value_type(part.dtype)} kiln_kept{k}[{row_len}];")
    for t, scalar, value, written in zip(form.statistics, form.scalars, form.stats, form.written):
        v = em.emit(value)
        held = em.fresh("row")
        em.line(f"const {d.value_type(t.dtype)} {held} = {v};")
        em.scopes[-1][Load(scalar, ()).key()] = held
        if written:
            em.line(f"{names[id(t)]}[o] = {d.store(t.dtype, held)};")
    for part in row_uniform_parts(result, form.e):
        em.emit(part)
    em.names[id(form.e)] = "e"
    em.reuse = True
    em.open(f"for (int64_t e = 0; e < {row_len}; ++e)")
    v = em.emit(result)
    em.line(f"{names[id(out)]}[o * {row_len} + e] = {d.store(out.dtype, v)};")
    em.close()
    em.close()
    body = "\n".join(em.lines)
    checks = [KernelCheck(c.error, c.message) for c in em.checks]
    params += sizes.declarations()
    return f"{d.prelude}\nvoid {kernel_name}({', '.join(params)}) {{\n{body}\n}}\n", checks, sizes


def schedule(lowered: Lowered) -> CpuProgram | None:
    """The one-loop CPU program of a row task (see the module doc); None for any other task,
    and for a few rows long enough to be worth splitting across threads (the loop nests of
    `kiln.schedule.cpu_auto` split the output's elements instead)."""
    found = row_task(lowered)
    if found is None:
        return None
    out, p = found
    if numel(out.shape[:p]) < FEW_ROWS and numel(out.shape) > PARALLEL_THRESHOLD:
        return None
    args = KernelArgs.args(len(lowered.inputs), len(lowered.outputs)) + [KernelArgs.STATUS]
    source, checks, sizes = render_rows(lowered, out, p, "kiln_kernel")
    return CpuProgram(source, "kiln_kernel", tuple(args), tuple(checks), sizes.values)
