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
"""
from __future__ import annotations

from dataclasses import dataclass

from kiln.template import CudaDialect, CudaProgram, KernelArgs, Launch, Template, dtypes, template_source

from kiln_ops_builtin import sorting
from kiln_ops_builtin.common import normalize_dim
from kiln_ops_builtin.templates.own_task import own_call

DEFINITIONS = {d.name: d for d in (sorting.sort, sorting.argsort, sorting.topk, sorting.kthvalue,
                                   sorting.median, sorting.nanmedian)}
MAX_TILE = {32: 8192, 64: 4096}       # items of 8 or 16 bytes in 64 KiB of shared memory
MIN_TILE = 1024                       # short rows share a CTA up to this many items
STATISTICS = {"kthvalue": "KTH", "median": "MEDIAN", "nanmedian": "NANMEDIAN"}

# the order-preserving key of a value in its storage type, and the largest key of the width (NaN's)
KEYS = {
    dtypes.float32: ("kiln_float_key(__float_as_uint(v), 0x80000000u, 0x7f800000u)", "0xffffffffu"),
    dtypes.float16: ("kiln_float_key((uint32_t)(v), 0x8000u, 0x7c00u)", "0xffffu"),
    dtypes.bfloat16: ("kiln_float_key((uint32_t)(v), 0x8000u, 0x7f80u)", "0xffffu"),
    dtypes.float64: ("kiln_float_key((uint64_t)__double_as_longlong(v), 0x8000000000000000ull, "
                     "0x7ff0000000000000ull)", "0xffffffffffffffffull"),
    dtypes.int64: ("((uint64_t)(v) ^ 0x8000000000000000ull)", None),
    dtypes.int32: ("((uint32_t)(v) ^ 0x80000000u)", None),
    dtypes.int16: ("((uint32_t)(uint16_t)(v) ^ 0x8000u)", None),
    dtypes.int8: ("((uint32_t)(uint8_t)(v) ^ 0x80u)", None),
    dtypes.uint8: ("((uint32_t)(v))", None),
    dtypes.boolean: ("((uint32_t)(v))", None),
}

KERNEL = r"""
#if KEY_BITS == 32
typedef uint32_t kiln_key;
typedef uint64_t kiln_item;
static __device__ __forceinline__ kiln_item kiln_item_of(kiln_key key, uint32_t at) { return ((uint64_t)key << 32) | at; }
static __device__ __forceinline__ kiln_key kiln_key_of(kiln_item a) { return (kiln_key)(a >> 32); }
static __device__ __forceinline__ uint32_t kiln_position_of(kiln_item a) { return (uint32_t)a; }
static __device__ __forceinline__ bool kiln_before(kiln_item a, kiln_item b) { return a < b; }
#else
typedef uint64_t kiln_key;
struct kiln_item { uint64_t key; uint32_t at; };
static __device__ __forceinline__ kiln_item kiln_item_of(kiln_key key, uint32_t at) { kiln_item a; a.key = key; a.at = at; return a; }
static __device__ __forceinline__ kiln_key kiln_key_of(kiln_item a) { return a.key; }
static __device__ __forceinline__ uint32_t kiln_position_of(kiln_item a) { return a.at; }
static __device__ __forceinline__ bool kiln_before(kiln_item a, kiln_item b) {
    return a.key < b.key || (a.key == b.key && a.at < b.at);
}
#endif

// The key of a float's bits (`sign` its sign bit, `inf` the bits of +inf): ordered as the
// values, -0.0 as 0.0, every NaN the largest key of the width
static __device__ __forceinline__ kiln_key kiln_float_key(kiln_key bits, kiln_key sign, kiln_key inf) {
    const kiln_key magnitude = bits & (sign - 1);
    if (magnitude > inf) return sign | (sign - 1);
    if (magnitude == 0) return sign;
    return (bits & sign) ? (~bits & (sign | (sign - 1))) : (bits | sign);
}

// The item of position j of row `row`: past the row's end (or the last row), one after every real item
static __device__ __forceinline__ kiln_item kiln_load(const ELEM* __restrict__ x, int64_t row, int64_t j) {
    if (j >= N || row >= ROWS) return kiln_item_of(~(kiln_key)0, (uint32_t)j);
    const ELEM v = x[(row / INNER * N + j) * INNER + row % INNER];
    const kiln_key key = KEY(v);
    return kiln_item_of(DESCENDING ? ~key : key, (uint32_t)j);
}

static __device__ __forceinline__ void kiln_order(kiln_item* a, kiln_item* b, bool up) {
    const kiln_item p = *a, q = *b;
    if (kiln_before(q, p) == up) { *a = q; *b = p; }
}

// The network's steps of merge sizes k_first..k_last (doubling) and strides below TILE over the
// TILE items `s` in shared memory, item i at position base + i % SEG of its row
static __device__ __forceinline__ void kiln_bitonic_tile(kiln_item* s, int64_t base, int64_t k_first, int64_t k_last) {
    for (int64_t k = k_first; k <= k_last; k <<= 1) {
        for (int j = (int)((k < TILE ? k : TILE) >> 1); j > 0; j >>= 1) {
            for (int p = threadIdx.x; p < TILE / 2; p += THREADS) {
                const int i = 2 * p - (p & (j - 1));
                kiln_order(s + i, s + i + j, ((base + (i & (SEG - 1))) & k) == 0);
            }
            __syncthreads();
        }
    }
}

// How many items of the sorted row `s` hold numbers (NaN's key is the largest but padding's)
static __device__ __forceinline__ int64_t kiln_numbers(const kiln_item* s) {
    int64_t lo = 0, hi = N;
    while (lo < hi) {
        const int64_t mid = (lo + hi) / 2;
        if (kiln_key_of(s[mid]) < (kiln_key)NAN_KEY) lo = mid + 1; else hi = mid;
    }
    return lo;
}

// Output element r (along the sorted dim) of row `row`, from its sorted items `s`
static __device__ __forceinline__ void kiln_emit(PARAMS, const kiln_item* s, int64_t row, int64_t r) {
#if STATISTIC_KTH
    const int64_t rank = KTH - 1;
#elif STATISTIC_MEDIAN
    const int64_t numbers = NAN_KEY ? kiln_numbers(s) : N;
    const int64_t rank = numbers < N ? numbers : (N - 1) / 2;
#elif STATISTIC_NANMEDIAN
    const int64_t numbers = NAN_KEY ? kiln_numbers(s) : N;
    const int64_t rank = (numbers > 0 ? numbers - 1 : 0) / 2;
#else
    const int64_t rank = r;
#endif
    const int64_t o = row / INNER, i = row % INNER, at = (o * KOUT + r) * INNER + i;
    const int64_t position = kiln_position_of(s[rank]);
#if VALUES
    out0[at] = in0[(o * N + position) * INNER + i];
#endif
    INDICES[at] = position;
}

#define KILN_SMEM kiln_item* s = (kiln_item*)kiln_smem

// Rows of NP <= TILE items: TILE / NP rows per CTA, sorted in shared memory, outputs written
extern "C" __global__ void __launch_bounds__(THREADS) kiln_sort_rows(PARAMS) {
    extern __shared__ uint4 kiln_smem[];
    KILN_SMEM;
    const int64_t row0 = (int64_t)blockIdx.x * (TILE / NP);
    for (int t = threadIdx.x; t < TILE; t += THREADS) s[t] = kiln_load(in0, row0 + t / NP, t % NP);
    __syncthreads();
    kiln_bitonic_tile(s, 0, 2, NP);
    for (int e = threadIdx.x; e < TILE / NP * EMITS; e += THREADS) {
        const int64_t row = row0 + e / EMITS;
        if (row < ROWS) kiln_emit(ARGS, s + (int64_t)(e / EMITS) * NP, row, e % EMITS);
    }
}
"""

LONG_ROWS = r"""
// Rows longer than TILE: chunk `blockIdx.x % CHUNKS` of row `blockIdx.x / CHUNKS` sorted (in the
// direction of a bitonic network's merge size TILE) into the temporary
extern "C" __global__ void __launch_bounds__(THREADS) kiln_sort_chunks(PARAMS) {
    extern __shared__ uint4 kiln_smem[];
    KILN_SMEM;
    const int64_t row = blockIdx.x / CHUNKS, base = (int64_t)(blockIdx.x % CHUNKS) * TILE;
    kiln_item* g = tmp0 + row * NP + base;
    for (int t = threadIdx.x; t < TILE; t += THREADS) s[t] = kiln_load(in0, row, base + t);
    __syncthreads();
    kiln_bitonic_tile(s, base, 2, TILE);
    for (int t = threadIdx.x; t < TILE; t += THREADS) g[t] = s[t];
}

// One step (merge size K, stride J >= TILE) over every row in the temporary
template <int64_t K, int64_t J>
static __device__ __forceinline__ void kiln_merge_step(kiln_item* __restrict__ items) {
    for (int64_t p = (int64_t)blockIdx.x * THREADS + threadIdx.x; p < ROWS * (NP / 2); p += (int64_t)gridDim.x * THREADS) {
        const int64_t row = p / (NP / 2), q = p % (NP / 2), i = 2 * q - (q & (J - 1));
        kiln_order(items + row * NP + i, items + row * NP + i + J, (i & K) == 0);
    }
}

// The steps of merge size K and strides below TILE over one chunk in shared memory
template <int64_t K>
static __device__ __forceinline__ void kiln_merge_chunk(kiln_item* __restrict__ items, kiln_item* s) {
    const int64_t row = blockIdx.x / CHUNKS, base = (int64_t)(blockIdx.x % CHUNKS) * TILE;
    kiln_item* g = items + row * NP + base;
    for (int t = threadIdx.x; t < TILE; t += THREADS) s[t] = g[t];
    __syncthreads();
    kiln_bitonic_tile(s, base, K, K);
    for (int t = threadIdx.x; t < TILE; t += THREADS) g[t] = s[t];
}

#define KILN_MERGE_STEP(K, J) extern "C" __global__ void __launch_bounds__(THREADS) \
    kiln_sort_step_##K##_##J(PARAMS) { kiln_merge_step<K, J>(tmp0); }
#define KILN_MERGE_CHUNK(K) extern "C" __global__ void __launch_bounds__(THREADS) kiln_sort_merge_##K(PARAMS) { \
    extern __shared__ uint4 kiln_smem[]; KILN_SMEM; kiln_merge_chunk<K>(tmp0, s); }

// The outputs, from the sorted rows in the temporary
extern "C" __global__ void __launch_bounds__(THREADS) kiln_sort_emit(PARAMS) {
    for (int64_t e = (int64_t)blockIdx.x * THREADS + threadIdx.x; e < ROWS * EMITS; e += (int64_t)gridDim.x * THREADS)
        kiln_emit(ARGS, tmp0 + e / EMITS * NP, e / EMITS, e % EMITS);
}
"""


@dataclass(frozen=True)
class Rows:
    """A sorting task as rows: ROWS rows of N elements, INNER apart (the elements of one row are
    x[o, 0..N, i] for row o * INNER + i), KOUT outputs per row along the sorted dim."""

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
    if x.ndim == 0 or x.dtype not in KEYS or any(o.shape and 0 in o.shape for o in task.outputs):
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


def space(level: int) -> list[dict]:
    """Level 0: the widest tile (shared memory) and up to 512 threads; 1 and 2 add thread counts
    and a smaller tile (more, shorter chunks for long rows)."""
    if level == 0:
        return [{}]
    return [{}, {"THREADS": 256}, {"THREADS": 1024}, {"TILE": 2048}]


def render(task, TILE: int = 0, THREADS: int = 0) -> CudaProgram:
    r = rows_of(task)
    if r is None:
        raise ValueError(f"sort_bitonic: does not take {task!r}")
    cap = MAX_TILE[r.key_bits]
    if TILE and (TILE & (TILE - 1) or not 2 <= TILE):
        raise ValueError(f"sort_bitonic: TILE must be a power of two >= 2, got {TILE}")
    tile = min(TILE or max(r.padded, MIN_TILE), cap)
    threads = THREADS or min(512, max(32, tile // 2))
    if threads % 32 or not 32 <= threads <= 1024:
        raise ValueError(f"sort_bitonic: THREADS must be a multiple of 32 in [32, 1024], got {THREADS}")
    np_ = r.padded
    long_rows = np_ > tile
    d = CudaDialect()
    outputs = task.outputs
    item_bytes = 8 if r.key_bits == 32 else 16
    decl = KernelArgs.params(d, task.inputs, outputs)
    args = KernelArgs.args(1, len(outputs))
    temporaries = []
    if long_rows:
        decl.append(f"kiln_item* __restrict__ {KernelArgs.temporary(0)}")
        args.append(KernelArgs.temporary(0))
        temporaries.append(((r.rows * np_ * item_bytes // 8,), dtypes.int64))
    statistic = STATISTICS.get(r.op, "")
    key, nan_key = KEYS[r.dtype]
    defines = {
        "KEY_BITS": r.key_bits, "ELEM": d.storage_type(r.dtype), "KEY(v)": key, "NAN_KEY": nan_key or 0,
        "N": f"((int64_t){r.n})", "NP": np_, "ROWS": f"((int64_t){r.rows})", "INNER": f"((int64_t){r.inner})",
        "KOUT": r.kout, "EMITS": 1 if statistic else r.kout, "DESCENDING": int(r.descending),
        "TILE": tile, "SEG": min(np_, tile), "THREADS": threads, "CHUNKS": np_ // tile if long_rows else 1,
        "STATISTIC_KTH": int(statistic == "KTH"), "STATISTIC_MEDIAN": int(statistic == "MEDIAN"),
        "STATISTIC_NANMEDIAN": int(statistic == "NANMEDIAN"), "KTH": r.kth,
        "VALUES": int(r.op != "argsort"), "INDICES": KernelArgs.output(len(outputs) - 1),
        "PARAMS": ", ".join(decl), "ARGS": ", ".join(args),
    }
    smem = tile * item_bytes
    block = (threads, 1, 1)
    names = tuple(args)
    if not long_rows:
        grid = (-(-r.rows // (tile // np_)), 1, 1)
        return CudaProgram(template_source([KERNEL], defines), [Launch("kiln_sort_rows", names, block, grid, smem=smem)])
    launches = [Launch("kiln_sort_chunks", names, block, (r.rows * (np_ // tile), 1, 1), smem=smem)]
    kernels = []
    k = 2 * tile
    while k <= np_:
        j = k // 2
        while j >= tile:
            kernels.append(f"KILN_MERGE_STEP({k}, {j})\n")
            launches.append(Launch(f"kiln_sort_step_{k}_{j}", names, block, items=r.rows * np_ // 2, per_block=threads))
            j //= 2
        kernels.append(f"KILN_MERGE_CHUNK({k})\n")
        launches.append(Launch(f"kiln_sort_merge_{k}", names, block, (r.rows * (np_ // tile), 1, 1), smem=smem))
        k *= 2
    launches.append(Launch("kiln_sort_emit", names, block, items=r.rows * defines["EMITS"], per_block=threads))
    return CudaProgram(template_source([KERNEL, LONG_ROWS, *kernels], defines), launches, temporaries)


TEMPLATE = Template("sort_bitonic", tuple(DEFINITIONS), "cuda", render, priority=10, applies=applies, space=space)
