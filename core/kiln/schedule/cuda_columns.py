"""The auto-scheduler's column-reduction rule: long reductions over leading dims that keep the
innermost one (batch-norm statistics over N, H and W of a channels-last tensor; sums over a
batch; a channels-last global average pool, over H and W, with the batch kept).

The general kernel gives each output element a block whose lanes stride over the values it
reduces; when the kept dim is the innermost, those values lie a whole row apart and every load
of a warp touches another 32-byte sector. Here a warp's lanes take 32 consecutive outputs, so
each load of the warp reads consecutive elements; the block's ROWS warps and the grid's `parts`
split the reduced values. The warps' partials combine through shared memory into a temporary
of (outputs, parts), which an ordinary kernel then reduces, applying what follows the reduction
(a mean's division). Applies to a buffer with one reduction of at least MIN_EXTENT values
(fixed sizes, not arg-reductions) whose loads that depend on the innermost output index (of
extent more than 1) take it as their own memory-innermost index (their last dim of more than one
element: a variance reads its (1, C, 1, 1) mean along C). Where one such buffer sums the squared
deviations of another's values from a center (a variance around its mean), the two share one
first pass (`kiln.schedule.cuda_moments`). It goes before the row rule, which
would take such a statistic as rows whose elements lie a row apart.
"""
from __future__ import annotations

from kiln.codegen.cuda import CudaDialect
from kiln.codegen.emitter import numel, reduce_init
from kiln.ir.compute import Compute
from kiln.ir.expr import Expr, Load, Reduce, top_reduces, walk
from kiln.ir.inline import Lowered
from kiln.ir.size import SymSize
from kiln.runtime.cuda import CudaProgram, Launch
from kiln.schedule.cuda_kernels import (TARGET_BLOCKS, AutoProgram, CudaEmitter, Kernel, at_item, reduce_extent,
                                        signature)
from kiln.schedule.cuda_moments import moment_pairs, write_moments
from kiln.schedule.cuda_split import write_split

LANES, ROWS = 32, 8
MIN_EXTENT = 512
MIN_PER_THREAD = 16              # values a thread reduces, at the least, before parts are added


def memory_inner(load: Load) -> int | None:
    """The position of `load`'s memory-innermost index: its last dim of more than one element
    (a (1, C, 1, 1) statistic's C); None for a load of a single element."""
    sized = [k for k, size in enumerate(load.tensor.shape) if size != 1]
    return sized[-1] if sized else None


def column_plan(buf: Compute) -> tuple[Reduce, int] | None:
    """(the reduction, how many parts its values split into) where `buf` is a column reduction."""
    kept = [k for k, size in enumerate(buf.shape) if size != 1]
    if not kept or any(isinstance(s, SymSize) for s in buf.shape) or buf.shape[kept[-1]] < LANES:
        return None
    reduces = top_reduces(buf.value)
    if len(reduces) != 1:
        return None
    r = reduces[0]
    if r.op in ("argmax", "argmin") or any(isinstance(a.extent, (Expr, SymSize)) for a in r.axes):
        return None
    extent = reduce_extent(r)
    if extent < MIN_EXTENT:
        return None
    inner = buf.axes[kept[-1]]
    mentions = lambda e: any(x is inner for x in walk(e))
    loads = [x for x in walk(r.body) if isinstance(x, Load) and any(map(mentions, x.indices))]
    if not loads or any(not _reads_along(x, inner, mentions) for x in loads):
        return None
    blocks = -(-numel(buf.shape) // LANES)
    parts = max(1, min(-(-TARGET_BLOCKS // blocks), extent // (ROWS * MIN_PER_THREAD)))
    return r, parts


def _reads_along(load: Load, inner, mentions) -> bool:
    """Whether `load` takes the output's innermost axis `inner` as its memory-innermost index
    and mentions it nowhere else (indices into dims of one element are never read)."""
    k = memory_inner(load)
    return (k is not None and load.indices[k] is inner
            and not any(mentions(i) for j, i in enumerate(load.indices) if j != k and load.tensor.shape[j] != 1))


def column_kernel(auto: AutoProgram, args: list, buf: Compute, r: Reduce, parts: int, out_name: str,
                  kernel_name: str) -> Kernel:
    """The kernel writing the (outputs, parts) partial reductions of `buf`'s reduction `r`."""
    d = CudaDialect()
    items, extent = numel(buf.shape), reduce_extent(r)
    body, names = at_item(buf, r.body, auto.names)
    em = CudaEmitter(d, names, auto.strides, "thread", indent=1, sizes=auto.sizes)
    t, vt = r.dtype, d.value_type(r.dtype)
    acc = em.fresh("acc")
    em.line(f"{vt} {acc} = {reduce_init(r.op, t, d)};")
    partial = em.open_partial(r.op, t, acc, -(-extent // (ROWS * parts)))
    chunk = -(-extent // parts)
    em.open(f"if (o < {items})")
    em.line("#pragma unroll 4")
    em.open(f"for (int64_t f = (int64_t)blockIdx.y * {chunk} + (threadIdx.x >> 5); "
            f"f < min((int64_t)(blockIdx.y + 1) * {chunk}, (int64_t){extent}); f += {ROWS})")
    em.unravel(r.axes, [str(a.extent) for a in r.axes], "f")
    em.add_partial(partial, r.op, t, acc, em.emit(body))
    em.close()
    em.close()
    em.close_partial(partial, acc)
    combine = d.combine(r.op, t, "total", "sh[w][threadIdx.x]")
    source = (f'extern "C" __global__ void __launch_bounds__({LANES * ROWS}) {kernel_name}({signature(d, args)}) {{\n'
              f"    const int64_t o = (int64_t)blockIdx.x * {LANES} + (threadIdx.x & {LANES - 1});\n"
              + "\n".join(em.lines) + "\n"
              f"    __shared__ {vt} sh[{ROWS}][{LANES + 1}];\n"
              f"    sh[threadIdx.x >> 5][threadIdx.x & {LANES - 1}] = {acc};\n"
              "    __syncthreads();\n"
              f"    if (threadIdx.x < {LANES} && o < {items}) {{\n"
              f"        {vt} total = sh[0][threadIdx.x];\n"
              f"        for (int w = 1; w < {ROWS}; ++w) {combine}\n"
              f"        {out_name}[o * {parts} + blockIdx.y] = {d.store(t, 'total')};\n"
              "    }\n}\n")
    launch = Launch(kernel_name, tuple(n for n, _, _ in args), (LANES * ROWS, 1, 1),
                    grid=(-(-items // LANES), parts, 1))
    return Kernel(source, launch)


def schedule(lowered: Lowered) -> CudaProgram | None:
    """The program of `lowered` with its column reductions in two passes, a sum and the squared
    deviations of its values in one first pass (`kiln.schedule.cuda_moments`); None when it has
    no column reduction."""
    plans = [column_plan(buf) for buf in lowered.buffers]
    if not any(plans):
        return None
    pairs = moment_pairs(lowered.buffers, plans)
    auto = AutoProgram(lowered)
    for n, (buf, plan) in enumerate(zip(lowered.buffers, plans)):
        if not numel(buf.shape):
            continue
        if n in pairs:
            write_moments(auto, n, buf, pairs[n], plan[1], LANES, ROWS)
        else:
            write_split(auto, n, buf, plan, column_kernel, "columns")
    return auto.program()
