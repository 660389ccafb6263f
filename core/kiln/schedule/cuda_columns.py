"""The auto-scheduler's column-reduction rule: long reductions over leading dims that keep the
innermost one (bias gradients, sums over a batch; batch-norm statistics over N, H and W of a
channels-last tensor; a channels-last global average pool, over H and W, with the batch kept).

The general kernel gives each output element a block whose lanes stride over the values it
reduces; when the kept dim is the innermost, those values lie a whole row apart and every load
of a warp touches another 32-byte sector. Here each lane takes V consecutive outputs along the
innermost kept dim (`e`), and reads each row's V values of a load as one aligned pack (a
*stream*, `kiln.schedule.cuda_streams`: 16 bytes of the narrowest type, 8 bf16 or 4 float32
values), so that a warp's load of a row is 32 consecutive packs, 512 bytes. V is the widest
for which every load that depends on `e` is a stream (their offsets and the innermost extent
multiples of V); else 1, with scalar loads. Each output accumulates in its own register, in
the reduction's type (float32 for 16-bit floats).

A block of BLOCK threads is `lanes` lanes of consecutive packs (a warp's 32, or as many as
the outputs have packs, where fewer: a warp then reads several rows) by `rows` groups that
split the reduced values, and the grid's `parts` split them further (`column_layout`): as many
parts as give TARGET_BLOCKS blocks, so that few outputs (768 bf16 values are 3 blocks wide)
still spread over every multiprocessor, as long as each thread keeps MIN_PER_THREAD values;
and at least as many as leave each thread PARTIAL_LENGTH values at most, so that its float sum
needs no partial sums. The groups' sums combine through shared memory into a temporary of
(outputs, parts), which an ordinary kernel then reduces, applying what follows the reduction
(a mean's division).

Applies to a buffer with one reduction of MIN_EXTENT to MAX_EXTENT values (fixed sizes, not
arg-reductions) whose loads that depend on the innermost output index (of extent LANES or more)
take it as their own memory-innermost index (their last dim of more than one element: a
variance reads its (1, C, 1, 1) mean along C). Where one such buffer sums the squared
deviations of another's values from a center (a variance around its mean), the two share one
first pass (`kiln.schedule.cuda_moments`, scalar loads). It goes before the row rule, which
would take such a statistic as rows whose elements lie a row apart.
"""
from __future__ import annotations

from dataclasses import dataclass

from kiln import dtypes
from kiln.codegen.cuda import CudaDialect
from kiln.codegen.emitter import numel, reduce_init
from kiln.ir.compute import Compute
from kiln.ir.expr import Expr, Load, Reduce, Var, as_expr, top_reduces, walk
from kiln.ir.inline import Lowered, substitute
from kiln.ir.simplify import simplify
from kiln.ir.size import SymSize
from kiln.runtime.cuda import CudaProgram, Launch
from kiln.schedule.cuda_kernels import (BLOCK, PARTIAL_LENGTH, TARGET_BLOCKS, AutoProgram, CudaEmitter, Kernel,
                                        reduce_extent, signature)
from kiln.schedule.cuda_moments import moment_pairs, write_moments
from kiln.schedule.cuda_split import write_split
from kiln.schedule.cuda_streams import find_streams, pack_alignment, pack_type, read_pack

LANES = 32                      # a block's lanes at most (a warp's): consecutive packs of outputs
MIN_EXTENT = 512
MIN_PER_THREAD = 8              # values a thread reduces, at the least, before parts are added
MAX_PARTS = 65535               # the grid's y dimension at most
MAX_EXTENT = MAX_PARTS * (BLOCK // LANES) * PARTIAL_LENGTH     # longer: more parts than the grid holds


@dataclass(eq=False)
class ColumnPlan:
    """How the first pass covers a column reduction `reduce` (see the module doc): its body
    at output (q, e) (`e` the innermost kept index, `q` the flat index of the others), the
    pack width `vector` and `streams` (load key -> Stream), and the block's `lanes` by `rows`
    and the grid's `parts`."""

    reduce: Reduce
    body: Expr
    q: Var
    e: Var
    vector: int
    streams: dict
    lanes: int
    rows: int
    parts: int


def column_layout(items: int, extent: int, vector: int) -> tuple[int, int, int]:
    """(lanes, rows, parts) of a first pass over `items` outputs in packs of `vector`, each
    reducing `extent` values (see the module doc)."""
    packs = items // vector
    lanes = min(LANES, 1 << (packs - 1).bit_length())
    rows = BLOCK // lanes
    blocks = -(-packs // lanes)
    parts = min(-(-TARGET_BLOCKS // blocks), extent // (rows * MIN_PER_THREAD))
    return lanes, rows, max(parts, -(-extent // (rows * PARTIAL_LENGTH)), 1)


def memory_inner(load: Load) -> int | None:
    """The position of `load`'s memory-innermost index: its last dim of more than one element
    (a (1, C, 1, 1) statistic's C); None for a load of a single element."""
    sized = [k for k, size in enumerate(load.tensor.shape) if size != 1]
    return sized[-1] if sized else None


def column_plan(buf: Compute, strides: dict) -> ColumnPlan | None:
    """The plan of `buf`'s first pass where it is a column reduction (`strides`: each loaded
    tensor's, by id); else None."""
    kept = [k for k, size in enumerate(buf.shape) if size != 1]
    if (not kept or any(isinstance(s, SymSize) for s in buf.shape) or not numel(buf.shape)
            or buf.shape[kept[-1]] < LANES):
        return None
    reduces = top_reduces(buf.value)
    if len(reduces) != 1:
        return None
    r = reduces[0]
    if r.op in ("argmax", "argmin") or any(isinstance(a.extent, (Expr, SymSize)) for a in r.axes):
        return None
    extent = reduce_extent(r)
    if not MIN_EXTENT <= extent <= MAX_EXTENT:
        return None
    inner = buf.axes[kept[-1]]
    mentions = lambda e: any(x is inner for x in walk(e))
    loads = [x for x in walk(r.body) if isinstance(x, Load) and any(map(mentions, x.indices))]
    if not loads or any(not _reads_along(x, inner, mentions) for x in loads):
        return None
    body, q, e = _at_column(buf, r.body, kept[-1])
    vector, streams = find_streams([body], strides, e, (q, *r.axes), e.extent, whole=True)
    lanes, rows, parts = column_layout(numel(buf.shape), extent, vector)
    return ColumnPlan(r, body, q, e, vector, streams, lanes, rows, parts)


def _reads_along(load: Load, inner, mentions) -> bool:
    """Whether `load` takes the output's innermost axis `inner` as its memory-innermost index
    and mentions it nowhere else (indices into dims of one element are never read)."""
    k = memory_inner(load)
    return (k is not None and load.indices[k] is inner
            and not any(mentions(i) for j, i in enumerate(load.indices) if j != k and load.tensor.shape[j] != 1))


def _at_column(buf: Compute, value: Expr, inner: int) -> tuple[Expr, Var, Var]:
    """(`value`, an expression of `buf`'s axes, at the output (q, e), q, e): `e` indexes the
    innermost kept dim (position `inner`; those after it are of one element), `q` is the
    row-major flat index of the dims before it."""
    q, e = Var("q", numel(buf.shape) // buf.shape[inner]), Var("e", buf.shape[inner])
    index, stride = {id(buf.axes[inner]): e}, 1
    for k in reversed(range(len(buf.shape))):
        axis, size = buf.axes[k], buf.shape[k]
        if k == inner:
            continue
        if size == 1:
            index[id(axis)] = as_expr(0, dtypes.int64)
        else:
            index[id(axis)] = simplify((q // stride) % size)
            stride *= size
    return simplify(substitute(value, index)), q, e


class PackEmitter(CudaEmitter):
    """A thread's emitter that reads the loads of `streams` (by key) from the packs read for
    the current row (`packs`: stream -> its C name), at the pack's element `kiln_j`."""

    def __init__(self, dialect, names, strides, streams: dict, sizes):
        super().__init__(dialect, names, strides, "thread", indent=1, sizes=sizes)
        self.streams = streams
        self.packs: dict = {}

    def emit(self, e: Expr) -> str:
        if isinstance(e, Load) and e.key() in self.streams:
            found = self._lookup(e.key())
            if found is None:
                pack = self.packs[self.streams[e.key()]]
                found = self.let(e.dtype, self.dialect.load(e.dtype, f"{pack}.v[kiln_j]"), e.key())
            return found
        return super().emit(e)


def column_kernel(auto: AutoProgram, args: list, buf: Compute, plan: ColumnPlan, out_name: str,
                  kernel_name: str) -> Kernel:
    """The kernel writing the (outputs, parts) partial reductions of `buf` by `plan`."""
    d = CudaDialect()
    r, v, lanes, rows, parts = plan.reduce, plan.vector, plan.lanes, plan.rows, plan.parts
    items, extent, width = numel(buf.shape), reduce_extent(r), plan.e.extent
    names = {**auto.names, id(plan.q): "kiln_q", id(plan.e): "kiln_e"}
    em = PackEmitter(d, names, auto.strides, plan.streams, auto.sizes)
    t, vt = r.dtype, d.value_type(r.dtype)
    em.line(f"const int kiln_lane = threadIdx.x % {lanes}, kiln_row = threadIdx.x / {lanes};")
    em.line(f"const int64_t kiln_p = (int64_t)blockIdx.x * {lanes} + kiln_lane;")
    em.line(f"const int64_t kiln_q = kiln_p * {v} / {width}, kiln_eb = kiln_p * {v} - kiln_q * {width};")
    em.line(f"{vt} acc[{v}];")
    em.line("#pragma unroll")
    em.line(f"for (int kiln_j = 0; kiln_j < {v}; ++kiln_j) acc[kiln_j] = {reduce_init(r.op, t, d)};")
    chunk = -(-extent // parts)
    em.open(f"if (kiln_p < {items // v})")
    em.line("#pragma unroll 4")
    em.open(f"for (int64_t f = (int64_t)blockIdx.y * {chunk} + kiln_row; "
            f"f < min((int64_t)(blockIdx.y + 1) * {chunk}, (int64_t){extent}); f += {rows})")
    em.unravel(r.axes, [str(a.extent) for a in r.axes], "f")
    for stream in dict.fromkeys(plan.streams.values()):
        em.packs[stream] = em.fresh("pk")
        pack = read_pack(d, stream, auto.names[id(stream.tensor)], em.emit(stream.base), "kiln_eb", v)
        em.line(f"const {pack_type(d, stream.tensor.dtype, v)} {em.packs[stream]} = {pack};")
    em.line("#pragma unroll")
    em.open(f"for (int kiln_j = 0; kiln_j < {v}; ++kiln_j)")
    em.line("const int64_t kiln_e = kiln_eb + kiln_j;")
    em.line(d.combine(r.op, t, "acc[kiln_j]", em.emit(plan.body)))
    em.close()
    em.close()
    em.close()
    combine = d.combine(r.op, t, "total", "kiln_sh[w][threadIdx.x]")
    source = (f'extern "C" __global__ void __launch_bounds__({BLOCK}) {kernel_name}({signature(d, args)}) {{\n'
              + "\n".join(em.lines) + "\n"
              f"    __shared__ {vt} kiln_sh[{rows}][{lanes * v}];\n"
              "    #pragma unroll\n"
              f"    for (int kiln_j = 0; kiln_j < {v}; ++kiln_j)\n"
              f"        kiln_sh[kiln_row][kiln_lane * {v} + kiln_j] = acc[kiln_j];\n"
              "    __syncthreads();\n"
              f"    const int64_t kiln_o = (int64_t)blockIdx.x * {lanes * v} + threadIdx.x;\n"
              f"    if (threadIdx.x < {lanes * v} && kiln_o < {items}) {{\n"
              f"        {vt} total = kiln_sh[0][threadIdx.x];\n"
              f"        for (int w = 1; w < {rows}; ++w) {combine}\n"
              f"        {out_name}[kiln_o * {parts} + blockIdx.y] = {d.store(t, 'total')};\n"
              "    }\n}\n")
    launch = Launch(kernel_name, tuple(n for n, _, _ in args), (BLOCK, 1, 1),
                    grid=(-(-items // (lanes * v)), parts, 1))
    return Kernel(source, launch, pack_alignment([s.tensor for s in plan.streams.values()], v))


def schedule(lowered: Lowered) -> CudaProgram | None:
    """The program of `lowered` with its column reductions in two passes, a sum and the squared
    deviations of its values in one first pass (`kiln.schedule.cuda_moments`); None when it has
    no column reduction."""
    auto = AutoProgram(lowered)
    plans = [column_plan(buf, auto.strides) for buf in lowered.buffers]
    if not any(plans):
        return None
    pairs = moment_pairs(lowered.buffers, plans)
    for n, (buf, plan) in enumerate(zip(lowered.buffers, plans)):
        if not numel(buf.shape):
            continue
        if n in pairs:
            lanes, rows, parts = column_layout(numel(buf.shape), reduce_extent(plan.reduce), 1)
            write_moments(auto, n, buf, pairs[n], parts, lanes, rows)
        else:
            write_split(auto, n, buf, plan, column_kernel, "columns")
    return auto.program()
