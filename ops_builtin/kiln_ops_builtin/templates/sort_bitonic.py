"""Sorting on CUDA: sort, argsort, topk, kthvalue, median and nanmedian by a bitonic network.

The operators' compute definitions (`kiln_ops_builtin.sorting`) count ranks, O(n^2) per row;
this template computes the same results, element for element, by sorting each row. Every
element becomes an item: an unsigned key that orders as PyTorch orders the values (signed
integers with the sign bit flipped, floats by their bits with negatives inverted, -0.0 as 0.0,
every NaN above every number; inverted for a descending order) and its position in the row.
Items sort by (key, position), so equal values keep their order (a stable sort, the order the
rank count defines), and the rows are padded to a power of two NP with items after every real
one. Keys of 32 bits and positions pack into one 64-bit word; 64-bit types use a pair.

Rows of up to TILE items (8192 for 32-bit keys, 4096 for 64-bit ones: 64 KiB of shared memory)
sort in one kernel, a CTA holding TILE / NP rows: load, every step of the network in shared
memory, then the outputs. Longer rows sort in chunks of TILE the same way into a temporary,
then merge in global memory: for each merge size k > TILE, one kernel per step of stride
j >= TILE (each thread orders one pair), then one kernel for the steps j < TILE in shared memory;
a last kernel writes the outputs. Output element r of a row reads the item of rank r: sort,
argsort and topk take ranks 0.., kthvalue k - 1, median (n - 1) // 2 (a row with NaN: its first
NaN, at the rank of the row's count of numbers), nanmedian (numbers - 1) // 2; values are read
back from the input at the item's position.

Takes the operators' own tasks (`own_task`: fusion leaves them alone) of every dtype, rows
shorter than 2^31 elements; mode keeps the rank count. Work is O(n log^2 n) per row; every step
of the network goes through shared memory (no register or warp-shuffle phases yet), and topk,
kthvalue and the medians sort whole rows (no radix selection).

The device code is `cuda/sort_bitonic.cuh`: `kiln::sort::Sort`, a class template over the element
type, the rows (`kiln::sort::Rows`), the knobs (`SortKnobs`) and the outputs, whose functions the
kernels call: `cuda/sort_bitonic_rows.cuh`'s for rows of at most TILE items; for longer ones
`cuda/sort_bitonic_chunks.cuh`'s, the merge steps' (instances of `Sort::merge_step` and
`merge_chunk`, one per merge size and stride, rendered here) and `cuda/sort_bitonic_emit.cuh`'s.
This module renders `kiln_sort_program` ahead of the kernels: its `Rows` and `Sort`, and where its
operands are. Sizes are compiled in: the launches (merge steps) depend on them.
"""
from __future__ import annotations

from dataclasses import dataclass

from kiln.template import (CudaDialect, CudaProgram, Knobs, KernelArgs, Launch, Template, device_code, dtypes,
                           template_source)

from kiln_ops_builtin import sorting
from kiln_ops_builtin.common import normalize_dim
from kiln_ops_builtin.templates.own_task import own_call

DEFINITIONS = {d.name: d for d in (sorting.sort, sorting.argsort, sorting.topk, sorting.kthvalue,
                                   sorting.median, sorting.nanmedian)}
MAX_TILE = {32: 8192, 64: 4096}       # items of 8 or 16 bytes in 64 KiB of shared memory
MIN_TILE = 1024                       # short rows share a CTA up to this many items
STATISTICS = {"kthvalue": "Kth", "median": "Median", "nanmedian": "NanMedian"}     # kiln::sort::Statistic
ELEMENTS = {dtypes.float32: "F32", dtypes.float16: "F16", dtypes.bfloat16: "BF16", dtypes.float64: "F64",
            dtypes.int64: "I64", dtypes.int32: "I32", dtypes.int16: "I16", dtypes.int8: "I8", dtypes.uint8: "U8",
            dtypes.boolean: "Bool"}   # kiln::sort's element types

# What the kernels (cuda/sort_bitonic_*.cuh) read of a program: its rows and sort (kiln::sort::Rows,
# kiln::sort::Sort) and where its operands are
PROGRAM = """
struct kiln_sort_program {{
    using rows = kiln::sort::Rows<{n}, {rows}, {inner}, {np}, {kout}, {emits}, {kth}>;
    using sort = kiln::sort::Sort<kiln::sort::{elem}, rows, {tile}, {threads}, {descending},
                                  kiln::sort::Statistic::{statistic}, {values}>;
    static __device__ __forceinline__ auto x(PARAMS) {{ return {x}; }}
    static __device__ __forceinline__ auto values(PARAMS) {{ return {values_arg}; }}
    static __device__ __forceinline__ auto indices(PARAMS) {{ return {indices}; }}
{items}}};
"""
ITEMS = "    static __device__ __forceinline__ auto items(PARAMS) {{ return {}; }}\n"
# The kernels of a long row's merge steps, instances of Sort's merge_step and merge_chunk:
# one a step of merge size k and stride j >= TILE, one a merge size's steps below TILE
STEP = """
extern "C" __global__ void __launch_bounds__(kiln_sort_program::sort::THREADS) kiln_sort_step_{k}_{j}(PARAMS) {{
    kiln_sort_program::sort::merge_step<{k}, {j}>(kiln_sort_program::items(ARGS));
}}
"""
MERGE = """
extern "C" __global__ void __launch_bounds__(kiln_sort_program::sort::THREADS) kiln_sort_merge_{k}(PARAMS) {{
    kiln_sort_program::sort::merge_chunk<{k}>(kiln_sort_program::items(ARGS));
}}
"""


@dataclass(frozen=True)
class SortKnobs(Knobs):
    """TILE items sorted in shared memory at once (a power of two; 0: the padded row, at least
    1024, at most 64 KiB of items) on THREADS threads a block (0: up to 512, one a pair of the
    tile's items)."""

    TILE: int = 0
    THREADS: int = 0

    def valid(self) -> bool:
        tile_ok = self.TILE == 0 or (self.TILE >= 2 and self.TILE & (self.TILE - 1) == 0)
        return tile_ok and (self.THREADS == 0 or (self.THREADS % 32 == 0 and 32 <= self.THREADS <= 1024))

    @classmethod
    def space(cls, level: int) -> list[SortKnobs]:
        """Level 0: the widest tile (shared memory) and up to 512 threads; 1 and 2 add thread
        counts and a smaller tile (more, shorter chunks for long rows)."""
        if level == 0:
            return [cls()]
        return [cls(), cls(THREADS=256), cls(THREADS=1024), cls(TILE=2048)]


@dataclass(frozen=True)
class Rows:
    """A sorting task as rows: `rows` rows of `n` elements, `inner` apart (the elements of one row
    are x[o, 0..n, i] for row o * inner + i), `kout` outputs per row along the sorted dim."""

    op: str
    dtype: dtypes.DataType
    rows: int
    n: int
    inner: int
    kout: int
    descending: bool
    kth: int = 0

    @property
    def key_bits(self) -> int:
        return 64 if self.dtype.nbytes == 8 else 32

    @property
    def padded(self) -> int:
        return 1 << max(0, (self.n - 1).bit_length())


def rows_of(task) -> Rows | None:
    """The rows `task` sorts, or None where the template does not take it."""
    definition = DEFINITIONS.get(task.name)
    call = own_call(task, definition) if definition is not None else None
    if call is None:
        return None
    x = call["x"]
    if x.ndim == 0 or x.dtype not in ELEMENTS or any(o.shape and 0 in o.shape for o in task.outputs):
        return None
    d = normalize_dim(task.name, call["dim"], x.ndim)
    n, outer, inner = x.shape[d], 1, 1
    for size in x.shape[:d]:
        outer *= size
    for size in x.shape[d + 1:]:
        inner *= size
    if n >= 1 << 31:
        return None
    kout = call["k"] if task.name == "topk" else n if task.name in ("sort", "argsort") else 1
    descending = bool(call.get("descending", call.get("largest", False)))
    return Rows(task.name, x.dtype, outer * inner, n, inner, kout, descending,
                call["k"] if task.name == "kthvalue" else 0)


def applies(task) -> bool:
    return rows_of(task) is not None


def render(task, **knobs) -> CudaProgram:
    """The program of `task` at the setting `knobs` (`SortKnobs`' fields)."""
    r = rows_of(task)
    if r is None:
        raise ValueError(f"sort_bitonic: does not take {task!r}")
    k = SortKnobs(**knobs)
    np_ = r.padded
    tile = min(k.TILE or max(np_, MIN_TILE), MAX_TILE[r.key_bits])
    threads = k.THREADS or min(512, max(32, tile // 2))
    long_rows = np_ > tile
    item_bytes = 8 if r.key_bits == 32 else 16
    decl = KernelArgs.params(CudaDialect(), task.inputs, task.outputs)
    args = KernelArgs.args(1, len(task.outputs))
    temporaries = []
    if long_rows:
        decl.append(f"kiln_sort_program::sort::item* __restrict__ {KernelArgs.temporary(0)}")
        args.append(KernelArgs.temporary(0))
        temporaries.append(((r.rows * np_ * item_bytes // 8,), dtypes.int64))
    statistic = STATISTICS.get(r.op, "Rank")
    emits = 1 if r.op in STATISTICS else r.kout
    values = r.op != "argsort"
    program = PROGRAM.format(
        n=r.n, rows=r.rows, inner=r.inner, np=np_, kout=r.kout, emits=emits, kth=r.kth, elem=ELEMENTS[r.dtype],
        tile=tile, threads=threads, descending=str(r.descending).lower(), statistic=statistic,
        values=str(values).lower(), x=KernelArgs.input(0), values_arg=KernelArgs.output(0) if values else "nullptr",
        indices=KernelArgs.output(len(task.outputs) - 1), items=ITEMS.format(KernelArgs.temporary(0)) * long_rows)
    defines = {"PARAMS": ", ".join(decl), "ARGS": ", ".join(args)}
    smem = tile * item_bytes
    block = (threads, 1, 1)
    names = tuple(args)
    if not long_rows:
        launches = [Launch("kiln_sort_rows", names, block, (-(-r.rows // (tile // np_)), 1, 1), smem=smem)]
        return CudaProgram(_source(program, defines, [device_code(__package__, "cuda/sort_bitonic_rows.cuh")]),
                           launches)
    kernels = [device_code(__package__, "cuda/sort_bitonic_chunks.cuh")]
    launches = [Launch("kiln_sort_chunks", names, block, (r.rows * (np_ // tile), 1, 1), smem=smem)]
    size = 2 * tile
    while size <= np_:
        j = size // 2
        while j >= tile:
            kernels.append(STEP.format(k=size, j=j))
            launches.append(Launch(f"kiln_sort_step_{size}_{j}", names, block, items=r.rows * np_ // 2,
                                   per_block=threads))
            j //= 2
        kernels.append(MERGE.format(k=size))
        launches.append(Launch(f"kiln_sort_merge_{size}", names, block, (r.rows * (np_ // tile), 1, 1), smem=smem))
        size *= 2
    kernels.append(device_code(__package__, "cuda/sort_bitonic_emit.cuh"))
    launches.append(Launch("kiln_sort_emit", names, block, items=r.rows * emits, per_block=threads))
    return CudaProgram(_source(program, defines, kernels), launches, temporaries)


def _source(program: str, defines: dict, kernels: list[str]) -> str:
    return template_source([device_code(__package__, "cuda/sort_bitonic.cuh"), program, *kernels], defines)


TEMPLATE = Template("sort_bitonic", tuple(DEFINITIONS), "cuda", render, priority=10, applies=applies,
                    space=SortKnobs.settings)
