"""Hopper GEMM engine: matmul, batched matmul and linear in float16/bfloat16 on sm_90a.

A persistent, warp-specialized kernel. One producer warpgroup (registers lowered with
`setmaxnreg.dec`) walks the CTA's output tiles and issues TMA copies (`cp.async.bulk.tensor`,
128-byte swizzled boxes) of BK = 64-deep slices of A and B into a STAGES-deep ring of shared
memory; each slot has a *full* mbarrier (the copies' transaction bytes) and an *empty* one (the
consumers' release). CW consumer warpgroups (`setmaxnreg.inc`) each own MI slabs of 64 rows x BN
columns of the BM x BN tile and multiply with `wgmma.mma_async.m64n{BN}k16` straight from shared
memory, one group in flight, then run the core's epilogue hooks (`KILN_STORE2`) while the
producer already fetches the next tile; each warp first stages 16 x 32 blocks of its
accumulators in shared memory, so every store instruction writes two whole 128-byte rows.
With PP = 1 (ping-pong) the two consumers take whole 64*MI x BN tiles in turn instead of sharing
one: named barriers let one consumer at a time run its main loop, and its epilogue overlaps the
other's MMA. Tiles are taken by a persistent grid of at most one CTA per SM, in groups of GROUP
tile rows (grouped rasterization) for L2 reuse.

Layouts are read as they are: a K-contiguous operand is loaded K-major, an M- or N-contiguous
one MN-major (64-element boxes) and multiplied with wgmma's transpose bit, so x @ W and x @ W.T
need no transpose kernel. Batch dimensions are the tensor maps' outer dimensions, per operand,
so an operand broadcast over a batch dimension (stride 0) simply has none. Edges come free: TMA
zero-fills out-of-range boxes and the stores are guarded. Split-K (SPLIT > 1) makes work units
(tile, split) and sums the float32 partials in `split_k`'s kernel.

Declines (older templates take over): other dtypes, strides TMA cannot describe (every non-unit
stride a multiple of 16 bytes, so K % 8 == 0 for K-major rows), more than three batch
dimensions per operand.
"""
from __future__ import annotations

from kiln import dtypes
from kiln.codegen import ptx
from kiln.codegen.cuda import template_source
from kiln.codegen.hooks import Contraction, Operand, match_contraction
from kiln.runtime.cuda import CudaProgram, Launch, TensorMapArg
from kiln.schedule import Template
from kiln_ops_builtin.templates import split_k

BK = 64
MAX_SMEM = 227 * 1024
DEFAULT = {"BN": 256, "CW": 2, "MI": 1, "STAGES": 4}
MN_LBO = 8192        # bytes between 64-element MN chunks of an MN-major stage (one 64 x 64 box)
SWIZZLE_ATOM = 1024  # bytes of eight 128-byte rows: the swizzle pattern's period
EPI_LD = 36          # floats per row of a warp's 16 x 32 epilogue staging block (padded against bank conflicts)

DEVICE = r"""
struct alignas(64) CUtensorMap { unsigned long long opaque[16]; };

static __device__ __forceinline__ uint32_t kiln_smem(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }
static __device__ __forceinline__ void kiln_bar_init(uint64_t* bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(kiln_smem(bar)), "r"(count));
}
static __device__ __forceinline__ void kiln_bar_expect(uint64_t* bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" :: "r"(kiln_smem(bar)), "r"(bytes) : "memory");
}
static __device__ __forceinline__ void kiln_bar_arrive(uint64_t* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" :: "r"(kiln_smem(bar)) : "memory");
}
static __device__ __forceinline__ void kiln_bar_wait(uint64_t* bar, int parity) {
    uint32_t done;
    do {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done) : "r"(kiln_smem(bar)), "r"(parity) : "memory");
    } while (!done);
}
// wgmma shared-memory descriptor, 128-byte swizzle; offsets in bytes
static __device__ __forceinline__ uint64_t kiln_gdesc(const void* p, uint32_t lbo, uint32_t sbo) {
    return (uint64_t)((kiln_smem(p) & 0x3FFFF) >> 4) | ((uint64_t)(lbo >> 4) << 16)
         | ((uint64_t)(sbo >> 4) << 32) | (1ull << 62);
}
"""


def _tma_helpers() -> str:
    """`kiln_tma_{r}d(dst, map, bar, c0 ..)`: one box copy of a rank-r map, completing on `bar`."""
    out = []
    for rank in range(2, 6):
        coords = ", ".join(f"int c{d}" for d in range(rank))
        slots = ", ".join(f"%{3 + d}" for d in range(rank))
        ins = ", ".join(f'"r"(c{d})' for d in range(rank))
        out.append(
            f"static __device__ __forceinline__ void kiln_tma_{rank}d(void* dst, const CUtensorMap* map, uint64_t* bar, {coords}) {{\n"
            f'    asm volatile("cp.async.bulk.tensor.{rank}d.shared::cluster.global.tile.mbarrier::complete_tx::bytes'
            f' [%0], [%1, {{{slots}}}], [%2];\\n"\n'
            f'                 :: "r"(kiln_smem(dst)), "l"((uint64_t)map), "r"(kiln_smem(bar)), {ins} : "memory");\n}}\n')
    return "".join(out)


KERNEL = r"""
extern "C" __global__ void __launch_bounds__(128 * (CW + 1), 1) kiln_matmul_sm90(PARAMS, const __grid_constant__ CUtensorMap tmA,
                                                                   const __grid_constant__ CUtensorMap tmB) {
    extern __shared__ unsigned char kiln_smem_raw[];
    uint16_t* As = (uint16_t*)(((uint64_t)kiln_smem_raw + 1023) & ~(uint64_t)1023);
    uint16_t* Bs = As + STAGES * BM * BK;
    uint64_t* full = (uint64_t*)(Bs + STAGES * BN * BK);
    uint64_t* empty = full + STAGES;
    float* epi = (float*)(empty + STAGES);      // CW * 4 warps x 16 x EPI_LD staged accumulators
    const int tid = threadIdx.x, wg = tid / 128;
    if (tid == 0) {
        for (int s = 0; s < STAGES; ++s) {
            kiln_bar_init(&full[s], 1);
            kiln_bar_init(&empty[s], PP ? 128 : CW * 128);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    const int tiles_m = (M + BM - 1) / BM, tiles_n = (N + BN - 1) / BN, per_batch = tiles_m * tiles_n;
    const int units = per_batch * BATCH * SPLIT;
    const int k_tiles = (K + BK - 1) / BK;
    int stage = 0, parity = 0;
    if (wg == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
        if (tid != 0) return;
        for (int unit = blockIdx.x; unit < units; unit += gridDim.x) {
            UNIT_COORDS
            for (int kt = kt0; kt < kt1; ++kt) {
                kiln_bar_wait(&empty[stage], parity ^ 1);
                kiln_bar_expect(&full[stage], STAGE_BYTES);
                uint16_t* as = As + stage * BM * BK;
                uint16_t* bs = Bs + stage * BN * BK;
                const int k0 = kt * BK;
                LOAD_A
                LOAD_B
                if (++stage == STAGES) { stage = 0; parity ^= 1; }
            }
        }
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" :: "n"(CONSUMER_REGS));
    const int c = wg - 1, t = tid % 128, w = t / 32, lane = t % 32;
    const int SLAB = PP ? 0 : c * MI;    // the consumer's first 64-row slab of the tile
    float acc[MI][BN / 2];
    int local = 0;
    for (int unit = blockIdx.x; unit < units; unit += gridDim.x, ++local) {
        UNIT_COORDS
        if (PP && local % CW != c) {        // the other consumer's tile: skip its stages
            const int passed = stage + (kt1 - kt0);
            stage = passed % STAGES;
            parity ^= (passed / STAGES) & 1;
            continue;
        }
        // ping-pong: one consumer in its main loop at a time (each full barrier then waits on the
        // phase right after the one last seen, so parities cannot alias); named barrier 1 + c
        // means "consumer c may start"
        if (PP && local > 0) asm volatile("bar.sync %0, 256;\n" :: "r"(1 + c) : "memory");
#pragma unroll
        for (int i = 0; i < MI; ++i)
#pragma unroll
            for (int j = 0; j < BN / 2; ++j) acc[i][j] = 0.f;
        int held = -1;
        for (int kt = kt0; kt < kt1; ++kt) {
            kiln_bar_wait(&full[stage], parity);
            const uint16_t* as = As + stage * BM * BK;
            const uint16_t* bs = Bs + stage * BN * BK;
            asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
            for (int kk = 0; kk < BK / 16; ++kk) {
                const uint64_t db = DESC_B(bs, kk);
#pragma unroll
                for (int i = 0; i < MI; ++i) WGMMA(acc[i], DESC_A(as + (SLAB + i) * 64 * BK, kk), db);
            }
            asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
            asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
            if (held >= 0) kiln_bar_arrive(&empty[held]);
            held = stage;
            if (++stage == STAGES) { stage = 0; parity ^= 1; }
        }
        asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
        if (held >= 0) kiln_bar_arrive(&empty[held]);
        if (PP && unit + gridDim.x < units) asm volatile("bar.arrive %0, 256;\n" :: "r"(2 - c) : "memory");
        // epilogue: each warp stages 16 x 32 blocks of its accumulators in shared memory and reads
        // them back a row-half per 16 lanes, so each store instruction covers two 128-byte rows
        float* staged = epi + (c * 4 + w) * 16 * EPI_LD;
#pragma unroll
        for (int i = 0; i < MI; ++i)
#pragma unroll
            for (int q = 0; q < BN / 32; ++q) {
#pragma unroll
                for (int jj = 0; jj < 4; ++jj)
#pragma unroll
                    for (int h = 0; h < 2; ++h)
                        *(float2*)&staged[(lane / 4 + h * 8) * EPI_LD + jj * 8 + (lane % 4) * 2] =
                            make_float2(acc[i][(q * 4 + jj) * 4 + h * 2], acc[i][(q * 4 + jj) * 4 + h * 2 + 1]);
                __syncwarp();
#pragma unroll
                for (int rr = 0; rr < 8; ++rr) {
                    const int row = rr * 2 + lane / 16, col = (lane % 16) * 2;
                    const float2 v = *(const float2*)&staged[row * EPI_LD + col];
                    const int64_t m = m0 + (SLAB + i) * 64 + w * 16 + row, n = n0 + q * 32 + col;
                    if (m < M && n + 1 < N) KILN_STORE2(bz, m, n, v.x, v.y);
                    else if (m < M && n < N) KILN_STORE(bz, m, n, v.x);
                }
                __syncwarp();
            }
    }
}
"""

# (unit -> split ks, flat batch bz, tile row/col); GROUP tile rows are walked column by column
UNIT_COORDS = (
    "const int ks = unit % SPLIT, tile = unit / SPLIT, bz = tile / per_batch, r = tile % per_batch;"
    " const int band = GROUP * tiles_n, first_m = r / band * GROUP, rows = min(tiles_m - first_m, GROUP);"
    " const int tm = first_m + r % band % rows, tn = r % band / rows;"
    " const int64_t m0 = (int64_t)tm * BM, n0 = (int64_t)tn * BN;"
    " const int kt0 = ks * KT_SPLIT, kt1 = min(k_tiles, kt0 + KT_SPLIT); (void)bz;")


def _batch_dims(c: Contraction, operand: Operand) -> list[tuple[int, int, int]] | None:
    """(divisor, size, stride) per tensor-map batch dimension of `operand`, innermost first: the
    coordinate is (bz / divisor) % size. Broadcast (stride 0) and size-1 dims are left out, and
    dims that are one contiguous run merge. None when more than three remain."""
    dims, inner = [], 1
    for size, stride in reversed(list(zip(c.batch, operand.batch_strides))):
        if size > 1 and stride:
            if dims and dims[-1][0] * dims[-1][1] == inner and dims[-1][2] * dims[-1][1] == stride:
                divisor, prev, s = dims[-1]
                dims[-1] = (divisor, prev * size, s)
            else:
                dims.append((inner, size, stride))
        inner *= size
    return dims if len(dims) <= 3 else None


def _operand_map(c: Contraction, operand: Operand, rows: int, extent: int, name: str):
    """The tensor map of `operand` (extent rows of M or N) with `rows`-row tiles, the C of its
    loads into the stage `dst`, and whether it is MN-major (wgmma's transpose bit)."""
    batch = _batch_dims(c, operand)
    if batch is None:
        return None
    coords = "".join(f", (int)(((int64_t)bz / {d}) % {s})" for d, s, _ in batch)
    rank = 2 + len(batch)
    bdims, bstrides = tuple(s for _, s, _ in batch), tuple(st for _, _, st in batch)
    x0 = "m0" if name == "A" else "n0"
    if operand.k_stride == 1:
        arg = TensorMapArg(operand.param, operand.dtype, (c.K, extent) + bdims, (1, operand.x_stride) + bstrides,
                           (BK, rows) + (1,) * len(batch))
        load = f"kiln_tma_{rank}d(dst, &tm{name}, &full[stage], k0, (int){x0}{coords});"
        return arg, load, 0
    if operand.x_stride == 1:
        arg = TensorMapArg(operand.param, operand.dtype, (extent, c.K) + bdims, (1, operand.k_stride) + bstrides,
                           (64, BK) + (1,) * len(batch))
        load = (f"for (int j = 0; j < {rows // 64}; ++j) kiln_tma_{rank}d(dst + j * 64 * BK, &tm{name}, &full[stage], "
                f"(int){x0} + j * 64, k0{coords});")
        return arg, load, 1
    return None


def _maps(c: Contraction, bm: int, bn: int):
    try:
        a = _operand_map(c, c.a, bm, c.M, "A")
        b = _operand_map(c, c.b, bn, c.N, "B")
    except ValueError:        # strides or boxes TMA cannot take
        return None
    return (a, b) if a and b else None


def _desc(trans: int) -> str:
    """DESC(stage, kk): the descriptor of k-slice kk (16 deep) of a stage, K- or MN-major."""
    if trans:
        return f"kiln_gdesc((S) + (KK) * 16 * 64, {MN_LBO}, {SWIZZLE_ATOM})"
    return f"(kiln_gdesc((S), 16, {SWIZZLE_ATOM}) + 2 * (KK))"


def smem_bytes(knobs: dict) -> int:
    bm = 64 * knobs["MI"] * (1 if knobs.get("PP") else knobs["CW"])
    return knobs["STAGES"] * ((bm + knobs["BN"]) * BK * 2 + 16) + 1024 + knobs["CW"] * 4 * 16 * EPI_LD * 4


def consumer_registers(cw: int) -> int:
    """Registers per consumer thread after `setmaxnreg`: what the 64K-register file leaves
    beside the producer warpgroup's 40, rounded down to a multiple of 8, at most 232."""
    return min(232, (65536 - 128 * 40) // (128 * cw) // 8 * 8)


def _fits(knobs: dict) -> bool:
    accumulators = knobs["BN"] // 2 * knobs["MI"]
    return (accumulators <= 128 and accumulators + 56 <= consumer_registers(knobs["CW"])
            and smem_bytes(knobs) <= MAX_SMEM and (not knobs.get("PP") or knobs["CW"] == 2))


def _k(bn, cw, mi, stages, pp=0) -> dict:
    return {"BN": bn, "CW": cw, "MI": mi, "STAGES": stages, **({"PP": 1} if pp else {})}


FIT_TILES = [split_k.Tile(_k(256, 2, 1, 4), 128, 256, BK, 2048), split_k.Tile(_k(128, 2, 1, 6), 128, 128, BK, 2048),
             split_k.Tile(_k(128, 1, 1, 8), 64, 128, BK, 2048), split_k.Tile(_k(256, 1, 1, 5), 64, 256, BK, 2048),
             split_k.Tile(_k(64, 1, 1, 8), 64, 64, BK, 2048), split_k.Tile(_k(128, 3, 1, 4), 192, 128, BK, 2048),
             split_k.Tile(_k(128, 2, 2, 6, 1), 128, 128, BK, 2048), split_k.Tile(_k(256, 2, 1, 5, 1), 64, 256, BK, 2048),
             split_k.Tile(_k(128, 2, 1, 8, 1), 64, 128, BK, 2048), split_k.Tile(_k(192, 2, 1, 5, 1), 64, 192, BK, 2048)]
"""`suggest`'s tiles (BM x BN: a ping-pong consumer takes a whole 64 * MI-row tile), at wgmma's
2048 float16 MACs per SM clock."""


def space(level: int) -> list[dict]:
    """Level 0: 128 x 256 on two consumer warpgroups, 4 stages; 1 and 2 add other tiles, depths,
    ping-pong consumers and split-K."""
    if level == 0:
        return [dict(DEFAULT)]
    out = [t.knobs for t in FIT_TILES] + [_k(128, 2, 2, 4), dict(DEFAULT, SPLIT=2)]
    if level == 2:
        out += [_k(256, 2, 1, 3), _k(128, 2, 1, 4), _k(128, 2, 2, 3), _k(128, 1, 2, 6), _k(256, 1, 1, 4),
                _k(192, 2, 1, 4), _k(192, 1, 1, 6), _k(64, 3, 1, 6)]
    return [dict(k) for k in out if _fits(k)]


PING_PONG = _k(128, 2, 1, 8, 1)
WAVE_TILES = [((128, 256), DEFAULT, 1.0), ((192, 128), _k(128, 3, 1, 4), 0.93),
              ((64, 192), _k(192, 2, 1, 5, 1), 0.8), ((64, 128), PING_PONG, 0.7),
              ((64, 128), _k(128, 1, 1, 8), 0.6)]
"""(tile, knobs, relative MMA rate): `suggest`'s choices for grids of most of a wave and more,
the rates fitted to the level-2 sweeps on an H200 (benchmarks/RESULTS.md)."""


def suggest(task, sm_count: int) -> list[dict]:
    """Knob settings for this shape, best guess first, then `split_k.rank`'s ranking of the
    cooperative tiles and split-K. Shapes of at least 0.7 of a wave of 64 x 128 tiles take the
    `WAVE_TILES` entry of least estimated time: waves (rounded up: a partial wave costs a whole
    one) x tile area x (K + a pipeline fill of two k-tiles) / rate. Smaller grids take 64 x 64,
    split over K up to a wave (at least four k-tiles per split)."""
    c = match_contraction(task)
    ranked = split_k.rank([t for t in FIT_TILES if not t.knobs.get("PP")], c.M, c.N, c.K, c.batch_count, sm_count, 2)
    tiles = lambda bm, bn: -(-c.M // bm) * -(-c.N // bn) * c.batch_count
    k_tiles = -(-c.K // BK)
    if tiles(64, 128) >= 0.7 * sm_count:
        cost = lambda entry: -(-tiles(*entry[0]) // sm_count) * entry[0][0] * entry[0][1] * (c.K + 2 * BK) / entry[2]
        first = dict(min(WAVE_TILES, key=cost)[1])
    else:
        first = _k(64, 1, 1, 8)
        split = min(-(-sm_count // tiles(64, 64)), k_tiles // 4)
        if tiles(64, 64) < 0.5 * sm_count and split > 1:
            first["SPLIT"] = split
    return [first] + [k for k in ranked if k != first]


def applies(task) -> bool:
    c = match_contraction(task)
    return (c is not None and c.K > 0 and c.a.dtype in (dtypes.float16, dtypes.bfloat16) and c.a.dtype == c.b.dtype
            and _maps(c, 64, 64) is not None and _maps(c, 256, 256) is not None)


def render(task, BN, CW, MI, STAGES, SPLIT=1, PP=0, GROUP=8) -> CudaProgram:
    c: Contraction = match_contraction(task)
    knobs = _k(BN, CW, MI, STAGES, PP)
    if not _fits(knobs):
        raise ValueError(f"gemm_sm90: knobs {knobs} need {smem_bytes(knobs)} bytes of shared memory "
                         f"(at most {MAX_SMEM}) or more than 128 accumulators per thread")
    bm = 64 * MI * (1 if PP else CW)
    (map_a, load_a, trans_a), (map_b, load_b, trans_b) = _maps(c, bm, BN)
    args, temporaries = tuple(c.args.split(", ")), []
    sk = split_k.plan(SPLIT, c.M, c.N, c.K, BK, c.batch_count, c.params, args, temporaries, split_index="ks")
    defines = {
        "BM": bm, "BN": BN, "BK": BK, "EPI_LD": EPI_LD, "CW": CW, "CONSUMER_REGS": consumer_registers(CW), "MI": MI, "PP": PP, "STAGES": STAGES, "GROUP": GROUP,
        "M": c.M, "N": c.N, "K": c.K, "ARGS": c.args, "STAGE_BYTES": (bm + BN) * BK * 2,
        "LOAD_A": "{ uint16_t* dst = as; " + load_a + " }", "LOAD_B": "{ uint16_t* dst = bs; " + load_b + " }",
        "UNIT_COORDS": UNIT_COORDS, "DESC_A(S, KK)": _desc(trans_a), "DESC_B(S, KK)": _desc(trans_b), **sk.defines,
    }
    source = template_source([ptx.wgmma_m64k16(BN, c.a.dtype, trans_a, trans_b), KERNEL, sk.source], defines, c.epilogue,
                             ptx=[DEVICE, _tma_helpers()])
    units = -(-c.M // bm) * -(-c.N // BN) * c.batch_count * SPLIT
    launches = [Launch("kiln_matmul_sm90", args + sk.args + (map_a, map_b), (128 * (CW + 1), 1, 1),
                       items=units, per_block=1, waves=1, smem=smem_bytes(knobs))] + sk.launches
    return CudaProgram(source, launches, temporaries, arch_suffix="a", min_arch=90, alignment=16)


TEMPLATE = Template("gemm_sm90", ("matmul", "linear"), "cuda", render, priority=30, applies=applies,
                    space=space, min_arch=90, suggest=suggest)
