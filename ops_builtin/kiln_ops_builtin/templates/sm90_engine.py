"""The Hopper contraction engine: one persistent, warp-specialized wgmma kernel that gemm_sm90
(matmul, linear) and conv_sm90 (implicit-GEMM convolution) instantiate.

One producer warpgroup (registers lowered with `setmaxnreg.dec`) walks the CTA's output tiles
and fills a STAGES-deep ring of shared memory with 128-byte-deep slices of K of A and B in the
layout TMA's 128-byte swizzle gives; each slot has a *full* mbarrier (the copies' transaction
bytes and arrivals) and an *empty* one (the consumers' release). How a slot is filled is the
instantiating template's `Producer`: thread 0 issues TMA box copies (`cp.async.bulk.tensor`)
after expecting their bytes, and where an operand is no box (the im2col of a convolution)
`threads` producer threads gather it with `cp.async` into the same swizzled layout, each
signalling the full barrier with `cp.async.mbarrier.arrive.noinc` (counted in its init count),
and the consumers fence the async proxy before reading such a slot.

A stage's rows are 128 bytes of K: KB = 64 elements of 16-bit operands, or 32 float32
operands that the tensor cores read as TF32 (`k_block`; TF32 operands must both be K-major).
CW consumer warpgroups (`setmaxnreg.inc`) each own MI slabs of 64 rows x BN columns of the
BM x BN tile and multiply with `wgmma.mma_async.m64n{BN}k16` (k8 for TF32: the same 32 bytes
of K) straight from shared memory, one group in flight, then run the core's epilogue hooks
(through split_k's `kiln_store2_fetched`) while the producer already fetches the next tile;
each warp first stages 16 x 32 blocks of its accumulators in shared memory, so every store
instruction writes two whole 128-byte rows. Where the output stores
16-byte packs (VEC), each lane instead takes VEC neighbouring outputs of a row through the
core's vector hook (`kiln_epilogue_v`). With TMA_STORE = 1, where the output is a 16-bit
matrix TMA can describe (`output_map`), each warp instead packs its 16 x 64 blocks straight from
the accumulators through `kiln_epilogue2_packed` into a 128-byte-swizzled 2 KB tile of shared
memory (the staging area, free then) and stores it with one TMA copy, which clips what lies past
M and N: nothing staged in float32, and the stores leave the load/store pipeline. What the
epilogue reads per element at m * row_stride + n (a residual: the match's `sources`) comes as
BM x BN tiles by TMA, issued by the producer after the tile's operands into one of two buffers
with their own full and empty mbarriers (`staged_stages`: the ring is made shallower where
shared memory needs it). With PP = 1 (ping-pong) the
two consumers take whole 64*MI x BN tiles in turn instead of sharing one: named barriers let
one consumer at a time run its main loop, and its epilogue overlaps the other's MMA. Tiles are
taken by a persistent grid of at most one CTA per SM, in groups of GROUP tile rows (grouped
rasterization) for L2 reuse. Split-K (SPLIT > 1) makes work units (tile, split) and sums the
float32 partials in `split_k`'s kernel. With CLUSTER = 2 the CTAs run in thread-block clusters
of two that take vertically adjacent tiles together: the producer of each loads its own A and
half of the shared B tile into both CTAs' slots (TMA multicast), so each slot's empty barrier
counts the releases of both CTAs' consumers (one per warp, the peer's by a remote arrive), and a
producer stays until the peer's last releases have arrived before its CTA may exit.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kiln.template import (Const, CudaDialect, CudaProgram, DataType, EpilogueOutput, EpilogueSource, KernelArgs,
                           Launch, SizeArgs, TensorMapArg, Var, dtypes, linear_terms, ptx, render_vector_epilogue,
                           row_major_strides, simplify, template_source, vector_stores)
from kiln_ops_builtin.templates import split_k

BK = 64              # 16-bit units in a stage's row: 128 bytes, the swizzle's width
MAX_SMEM = 227 * 1024
MN_LBO = 8192        # bytes between 64-element MN chunks of an MN-major stage (one 64 x 64 box)
SWIZZLE_ATOM = 1024  # bytes of eight 128-byte rows: the swizzle pattern's period
EPI_LD = 36          # floats per row of a warp's 16 x 32 epilogue staging block (padded against bank conflicts)
REGISTERS = 65536     # the register file, shared out between the warpgroups by setmaxnreg
EPILOGUE_REGS = 72    # a consumer's registers besides its accumulators and fetched values

KERNEL = r"""
extern "C" __global__ void __launch_bounds__(128 * (CW + 1), 1) KERNEL_NAME(PARAMS, TENSOR_MAPS) {
    extern __shared__ unsigned char kiln_smem_raw[];
    uint16_t* As = (uint16_t*)(((uint64_t)kiln_smem_raw + 1023) & ~(uint64_t)1023);
    uint16_t* Bs = As + STAGES * BM * BK;
    unsigned char* srcs = (unsigned char*)(Bs + STAGES * BN * BK);   // two buffers of the epilogue's source tiles
    uint64_t* full = (uint64_t*)(srcs + 2 * SRC_BYTES);
    uint64_t* empty = full + STAGES;
    uint64_t* src_full = empty + STAGES;
    uint64_t* src_empty = src_full + 2;
    float* epi = (float*)(src_empty + 2);      // CW * 4 warps x 16 x EPI_LD staged accumulators
    const int tid = threadIdx.x, wg = tid / 128;
    if (tid == 0) {
        for (int s = 0; s < STAGES; ++s) {
            kiln_bar_init(&full[s], FULL_ARRIVALS);
            kiln_bar_init(&empty[s], EMPTY_ARRIVALS);
        }
        for (int s = 0; s < 2; ++s) {
            kiln_bar_init(&src_full[s], 1);
            kiln_bar_init(&src_empty[s], PP ? 128 : CW * 128);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
#if CLUSTER > 1
    kiln_cluster_sync();        // the peers' barriers are ready before anything arrives on them
    const int rank = kiln_cluster_rank();
#else
    __syncthreads();
    const int rank = 0;
#endif
    // work units are CLUSTER vertically adjacent tiles, one per CTA of a cluster
    const int tiles_m = (M + BM * CLUSTER - 1) / (BM * CLUSTER), tiles_n = (N + BN - 1) / BN, per_batch = tiles_m * tiles_n;
    const int units = per_batch * BATCH * kiln_split_k_program::SPLIT;
    const int k_tiles = (K + KB - 1) / KB;
    int stage = 0, parity = 0;
    if (wg == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" :: "n"(PRODUCER_REGS));
        if (tid >= PRODUCERS) return;
        int local = 0;
        for (int unit = blockIdx.x / CLUSTER; unit < units; unit += gridDim.x / CLUSTER, ++local) {
            UNIT_COORDS
            TILE_SETUP
            for (int kt = kt0; kt < kt1; ++kt) {
                kiln_bar_wait(&empty[stage], parity ^ 1);
                uint16_t* as = As + stage * BM * BK;
                uint16_t* bs = Bs + stage * BN * BK;
                const int k0 = kt * KB;
                if (tid == 0) {
                    kiln_bar_expect(&full[stage], TMA_BYTES);
                    LOAD_TMA
                }
                GATHER
                if (++stage == STAGES) { stage = 0; parity ^= 1; }
            }
#if NSRC
            // the tile's epilogue sources, into buffer local % 2 once its previous tile's epilogue is done
            if (tid == 0) {
                const int sb = local % 2;
                kiln_bar_wait(&src_empty[sb], ((local / 2) & 1) ^ 1);
                kiln_bar_expect(&src_full[sb], SRC_BYTES);
                LOAD_SOURCES
            }
#endif
        }
        asm volatile("cp.async.wait_all;\n" ::: "memory");
#if CLUSTER > 1
        // the peers' consumers release into this CTA's barriers: stay until the last have arrived
        for (int s = 0; s < STAGES; ++s) {
            kiln_bar_wait(&empty[stage], parity ^ 1);
            if (++stage == STAGES) { stage = 0; parity ^= 1; }
        }
#endif
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" :: "n"(CONSUMER_REGS));
    const int c = wg - 1, t = tid % 128, w = t / 32, lane = t % 32;
    const int SLAB = PP ? 0 : c * MI;    // the consumer's first 64-row slab of the tile
    float acc[MI][BN / 2];
    int local = 0;
    for (int unit = blockIdx.x / CLUSTER; unit < units; unit += gridDim.x / CLUSTER, ++local) {
        UNIT_COORDS
        if (PP && local % CW != c) {        // the other consumer's tile: skip its stages
            const int passed = stage + (kt1 - kt0);
            stage = passed % STAGES;
            parity ^= (passed / STAGES) & 1;
            continue;
        }
        // what the epilogue reads per row (a residual) goes to L2 while the tile's main loop runs
        for (int p = t; p < 64 * MI * (BN / 32); p += 128) {
            const int64_t m = m0 + SLAB * 64 + p / (BN / 32), n = n0 + p % (BN / 32) * 32;
            if (m < M && n < N) kiln_store_prefetch(KERNEL_ARGS, bz, m, n);
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
            if (GATHERED) asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // cp.async wrote it
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
            if (held >= 0) RELEASE(&empty[held]);
            held = stage;
            if (++stage == STAGES) { stage = 0; parity ^= 1; }
        }
        asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
        if (held >= 0) RELEASE(&empty[held]);
        if (PP && unit + gridDim.x / CLUSTER < units) asm volatile("bar.arrive %0, 256;\n" :: "r"(2 - c) : "memory");
#if NSRC
        const int sb = local % 2;
        kiln_bar_wait(&src_full[sb], (local / 2) & 1);
#endif
        // epilogue: each warp stages 16 x 32 blocks of its accumulators in shared memory and reads
        // them back a row-half per 16 lanes, so each store instruction covers two 128-byte rows;
        // what the epilogue reads per row (a residual) is loaded FETCH blocks ahead of the block
        // being stored, so that that many blocks' loads are in flight at once
        float* staged = epi + (c * 4 + w) * 16 * EPI_LD;
#if TMA_STORE
        // each warp packs its 16 x 64 blocks of outputs into a 128-byte-swizzled 2 KB tile (in
        // the staging area, unused here) and stores it by TMA, which clips what lies past M and N
        unsigned char* packed = (unsigned char*)(((uint64_t)epi + 1023) & ~(uint64_t)1023) + (c * 4 + w) * 2048;
#pragma unroll
        for (int i = 0; i < MI; ++i) {
#pragma unroll
            for (int q = 0; q < BN / 64; ++q) {
                if (lane == 0) kiln_bulk_wait_read<0>();      // the tile's last store has read it
                __syncwarp();
#pragma unroll
                for (int jj = 0; jj < 8; ++jj)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int row = lane / 4 + h * 8, col = q * 64 + jj * 8 + (lane % 4) * 2;
                        const int64_t m = m0 + (SLAB + i) * 64 + w * 16 + row, n = n0 + col;
                        const float* v = &acc[i][(q * 8 + jj) * 4 + h * 2];
                        *(uint32_t*)(packed + row * 128 + ((jj ^ (row & 7)) * 16) + (lane % 4) * 4) =
                            m < M && n + 1 < N ? KILN_PACK2(bz, m, n, v[0], v[1]) : 0u;
                    }
                asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
                __syncwarp();
                if (lane == 0) {
                    STORE_TILE(packed, (int)(n0 + q * 64), (int)(m0 + (SLAB + i) * 64 + w * 16));
                    kiln_bulk_commit();
                }
            }
        }
#elif VEC
        // each lane stores VEC neighbouring outputs of a row (16 bytes) through the vector hook
#pragma unroll
        for (int i = 0; i < MI; ++i) {
#pragma unroll
            for (int q = 0; q < BN / 32; ++q) {
                STAGE_BLOCK
#pragma unroll
                for (int h = 0; h < 16 / VEC; ++h) {
                    const int row = h * VEC + lane / (32 / VEC), col = lane % (32 / VEC) * VEC;
                    float v[VEC];
#pragma unroll
                    for (int e = 0; e < VEC; e += 4) *(float4*)&v[e] = *(const float4*)&staged[row * EPI_LD + col + e];
                    const int64_t m = m0 + (SLAB + i) * 64 + w * 16 + row, n = n0 + q * 32 + col;
                    if (m < M && n < N) KILN_STORE_V(bz, m, n, v, ((SLAB + i) * 64 + w * 16 + row) * BN + q * 32 + col);
                }
                __syncwarp();
            }
        }
#else
        auto fetch_rows = [&](int i, int q, kiln_fetched* fetched) {
#pragma unroll
            for (int rr = 0; rr < 8; ++rr) {
                const int64_t m = m0 + (SLAB + i) * 64 + w * 16 + rr * 2 + lane / 16, n = n0 + q * 32 + (lane % 16) * 2;
                if (m < M && n + 1 < N)
                    KILN_FETCH_AT(bz, m, n, fetched[rr], ((SLAB + i) * 64 + w * 16 + rr * 2 + lane / 16) * BN + q * 32 + (lane % 16) * 2);
            }
        };
#pragma unroll
        for (int i = 0; i < MI; ++i) {
            kiln_fetched fetched[FETCH + 1][8];
#pragma unroll
            for (int q = 0; q < FETCH && q < BN / 32; ++q) fetch_rows(i, q, fetched[q]);
#pragma unroll
            for (int q = 0; q < BN / 32; ++q) {
                if (q + FETCH < BN / 32) fetch_rows(i, q + FETCH, fetched[(q + FETCH) % (FETCH + 1)]);
                STAGE_BLOCK
#pragma unroll
                for (int rr = 0; rr < 8; ++rr) {
                    const int row = rr * 2 + lane / 16, col = (lane % 16) * 2;
                    const float2 v = *(const float2*)&staged[row * EPI_LD + col];
                    const int64_t m = m0 + (SLAB + i) * 64 + w * 16 + row, n = n0 + q * 32 + col;
                    if (m < M && n + 1 < N)
                        kiln_store2_fetched(KERNEL_ARGS, ks, bz, m, n, v.x, v.y, fetched[q % (FETCH + 1)][rr]);
                    else if (m < M && n < N) kiln_store(KERNEL_ARGS, ks, bz, m, n, v.x);
                }
                __syncwarp();
            }
        }
#endif
#if NSRC
        kiln_bar_arrive(&src_empty[sb]);
#endif
    }
#if TMA_STORE
    if (lane == 0) kiln_bulk_wait_read<0>();           // shared memory outlives the last store's reads
#endif
}
"""

# a warp's 16 x 32 block q of slab i of its accumulators into its staging block (rows of EPI_LD floats)
STAGE_BLOCK = (
    "for (int jj = 0; jj < 4; ++jj) for (int h = 0; h < 2; ++h) "
    "*(float2*)&staged[(lane / 4 + h * 8) * EPI_LD + jj * 8 + (lane % 4) * 2] = "
    "make_float2(acc[i][(q * 4 + jj) * 4 + h * 2], acc[i][(q * 4 + jj) * 4 + h * 2 + 1]); __syncwarp();")

# (unit -> split ks, flat batch bz, tile row/col); GROUP tile rows are walked column by column
UNIT_COORDS = (
    "const int ks = unit % kiln_split_k_program::SPLIT, tile = unit / kiln_split_k_program::SPLIT;"
    " const int bz = tile / per_batch, r = tile % per_batch;"
    " const int band = GROUP * tiles_n, first_m = r / band * GROUP, rows = min(tiles_m - first_m, GROUP);"
    " const int tm = (first_m + r % band % rows) * CLUSTER + rank, tn = r % band / rows;"
    " const int64_t m0 = (int64_t)tm * BM, n0 = (int64_t)tn * BN;"
    " const int kt0 = ks * KT_SPLIT, kt1 = min(k_tiles, kt0 + KT_SPLIT); (void)bz;")


@dataclass
class Producer:
    """How the producer warpgroup fills a ring slot (`as`, `bs`: the slot's A and B tiles;
    `k0`: the slice's first k; `m0`, `n0`: the tile's corner; `full[stage]`: its barrier).

    Thread 0 expects `tma_bytes` and runs `tma` (TMA copies of the `maps`, kernel parameters
    `tm{name}`); with `threads` > 1, each of them runs `tile_setup` once per tile and `gather`
    per slot, which must end with one `kiln_bar_arrive_cp_async(&full[stage])` per thread.
    `trans_a`/`trans_b` are 1 for an MN-major tile (wgmma's transpose bit). `regs` is the
    producer's register budget; `defines` and `source` (device code) go with the program."""

    maps: dict[str, TensorMapArg]
    tma: str
    tma_bytes: int
    trans_a: int = 0
    trans_b: int = 0
    threads: int = 1
    tile_setup: str = ""
    gather: str = ""
    regs: int = 40
    defines: dict = field(default_factory=dict)
    source: str = ""


def k_block(dtype: DataType) -> int:
    """Elements of K in one 128-byte stage row: 64 for 16-bit operands, 32 for TF32 (float32)."""
    return 128 // dtype.nbytes


def wgmma(bn: int, dtype: DataType, trans_a: int, trans_b: int) -> str:
    """The WGMMA macro for operands of `dtype` (16-bit, or float32 read as TF32, K-major only)."""
    if dtype == dtypes.float32:
        if trans_a or trans_b:
            raise ValueError("TF32 wgmma reads K-major operands only")
        return ptx.wgmma_m64k8_tf32(bn)
    return ptx.wgmma_m64k16(bn, dtype, trans_a, trans_b)


@dataclass
class Problem:
    """A batch x M x N x K contraction with operands of `dtype` (16-bit floats, or float32 read
    as TF32), and its kernel parameters, their names (`args`), the epilogue hooks the core
    rendered and the inputs the epilogue reads per element (`kiln.codegen.hooks.EpilogueSource`).
    Symbolic sizes among M, N, K and batch (`kiln.ir.size.SymSize`) are written through `sizes`,
    whose parameters end `params`; its values go with the program."""

    M: int
    N: int
    K: int
    batch: int
    dtype: DataType
    params: str
    args: str
    epilogue: str
    sizes: SizeArgs = field(default_factory=SizeArgs)
    sources: tuple[EpilogueSource, ...] = ()
    output: EpilogueOutput | None = None


def tile_knobs(bn, cw, mi, stages, pp=0) -> dict:
    """A knob setting: BN columns, CW consumer warpgroups of MI 64-row slabs, STAGES slots, PP."""
    return {"BN": bn, "CW": cw, "MI": mi, "STAGES": stages, **({"PP": 1} if pp else {})}


def block_m(knobs: dict) -> int:
    """The tile's rows: 64 * MI per consumer, times CW unless they take tiles in turn (PP)."""
    return 64 * knobs["MI"] * (1 if knobs.get("PP") else knobs["CW"])


def smem_bytes(knobs: dict, sources: tuple[EpilogueSource, ...] = ()) -> int:
    """Shared memory of a setting: the ring, two buffers of the epilogue's source tiles, the
    barriers, the epilogue's staging blocks and 1024 bytes of alignment."""
    return (knobs["STAGES"] * ((block_m(knobs) + knobs["BN"]) * BK * 2 + 16) + 2 * source_bytes(knobs, sources) + 32
            + 1024 + knobs["CW"] * 4 * 16 * EPI_LD * 4)


def source_bytes(knobs: dict, sources: tuple[EpilogueSource, ...]) -> int:
    """Bytes of one tile of every epilogue source."""
    return sum(block_m(knobs) * knobs["BN"] * s.dtype.nbytes for s in sources)


MIN_STAGED_STAGES = 3
MAX_STAGED_K_TILES = 16
"""Staging pays where the sources' reads weigh against a short main loop (ResNet's 1x1
convolutions, K <= 512); on longer ones the shallower ring costs more than the epilogue's loads
from global memory (H100, a linear of 1576 x 3072 -> 768 with two residuals: 23.8 us staged at 3
stages, 19.6 us loading them; at K = 768 staging wins or ties)."""


def staged_stages(knobs: dict, sources: tuple[EpilogueSource, ...], k_tiles: int) -> int | None:
    """The ring depth (at most STAGES, at least MIN_STAGED_STAGES) at which the setting also
    holds two buffers of the source tiles, or None where it cannot or should not (sources then
    load from global memory in the epilogue): split-K stages nothing (its partials' sum reads
    them), nor does a main loop of more than MAX_STAGED_K_TILES k-tiles."""
    if (not sources or knobs.get("SPLIT", 1) > 1 or k_tiles > MAX_STAGED_K_TILES
            or any(s.row_stride * s.dtype.nbytes % 16 for s in sources)):
        return None
    for stages in range(knobs["STAGES"], MIN_STAGED_STAGES - 1, -1):
        if smem_bytes(dict(knobs, STAGES=stages), sources) <= MAX_SMEM:
            return stages
    return None


def consumer_registers(cw: int, producer_regs: int = 40, most: int = 232) -> int:
    """Registers per consumer thread after `setmaxnreg`: what the register file leaves beside
    the producer warpgroup's, rounded down to a multiple of 8, at most `most`."""
    return min(most, (REGISTERS - 128 * producer_regs) // (128 * cw) // 8 * 8)


def fits(knobs: dict, producer_regs: int = 40) -> bool:
    """Whether the setting fits shared memory and, at 128 accumulators per thread at most, the
    consumers' registers (ping-pong: CW = 2)."""
    accumulators = knobs["BN"] // 2 * knobs["MI"]
    return (accumulators <= 128 and accumulators + 56 <= consumer_registers(knobs["CW"], producer_regs)
            and smem_bytes(knobs) <= MAX_SMEM and (not knobs.get("PP") or knobs["CW"] == 2))


def stage_desc(trans: int) -> str:
    """DESC(stage, kk): the descriptor of k-slice kk (16 deep) of a stage, K- or MN-major."""
    if trans:
        return f"kiln_gdesc((S) + (KK) * 16 * 64, {MN_LBO}, {SWIZZLE_ATOM})"
    return f"(kiln_gdesc((S), 16, {SWIZZLE_ATOM}) + 2 * (KK))"


def fetch_depth(knobs: dict, producer_regs: int = 40) -> int:
    """How many 16 x 32 epilogue blocks ahead a consumer loads what the epilogue reads (1 to
    BN / 32 - 1, at most 3): as many as the registers the accumulators leave hold, a block
    taking 16 (one 16-bit residual: 8 rows x 2 values)."""
    free = consumer_registers(knobs["CW"], producer_regs) - knobs["BN"] // 2 * knobs["MI"] - EPILOGUE_REGS
    return max(1, min(free // 16 - 1, knobs["BN"] // 32 - 1, 3))


def program(kernel: str, p: Problem, producer: Producer, BN, CW, MI, STAGES, SPLIT=1, PP=0, GROUP=8,
            FETCH=None, CLUSTER=1, TMA_STORE=0) -> CudaProgram:
    """The engine's program for problem `p` filled by `producer`, kernel named `kernel` (FETCH:
    see `fetch_depth`, its default). Where `staged_stages` allows, the epilogue's sources come
    as tiles by TMA, and the ring is that deep. With CLUSTER = 2 the CTAs run in clusters of two
    that take vertically adjacent tiles together, and `producer` fills both CTAs' slots of what
    they share (by TMA multicast, rank `rank` of the pair issuing its half): each slot is then
    released by the consumers of both CTAs. With TMA_STORE = 1 the epilogue stores its outputs
    by TMA where `output_map` can describe them (else it stores as without)."""
    knobs = tile_knobs(BN, CW, MI, STAGES, PP)
    if CLUSTER not in (1, 2) or (CLUSTER > 1 and producer.threads > 1):
        raise ValueError(f"{kernel}: CLUSTER={CLUSTER}; the engine runs clusters of 1 or 2 CTAs, "
                         "and of 2 only where the producer loads by TMA alone")
    if not fits(knobs, producer.regs):
        raise ValueError(f"{kernel}: knobs {knobs} need {smem_bytes(knobs)} bytes of shared memory "
                         f"(at most {MAX_SMEM}) or more accumulators than the consumers' registers hold")
    stages = staged_stages(dict(knobs, SPLIT=SPLIT), p.sources, -(-p.K // k_block(p.dtype)))
    sources = p.sources if stages else ()
    knobs["STAGES"] = stages or STAGES
    args, temporaries = tuple(p.args.split(", ")), []
    kb = k_block(p.dtype)
    sk = split_k.plan(SPLIT, p.M, p.N, p.K, kb, p.batch, p.params, args, temporaries, text=p.sizes.text)
    gathered = producer.threads > 1
    maps = {**producer.maps, **_source_maps(sources, p.M, p.N, block_m(knobs), BN)}
    vector, vector_hook = _vector_epilogue(p, SPLIT, sources)
    out_map = output_map(p) if TMA_STORE and SPLIT == 1 and not sources else None
    if out_map:
        maps["O"] = out_map[0]
    defines = {
        "KERNEL_NAME": kernel, "TENSOR_MAPS": ", ".join(f"const __grid_constant__ CUtensorMap tm{name}" for name in maps),
        "BM": block_m(knobs), "BN": BN, "BK": BK, "KB": kb, "EPI_LD": EPI_LD, "CW": CW, "MI": MI, "PP": PP,
        "STAGES": knobs["STAGES"], **_source_defines(sources, knobs, SPLIT),
        "GROUP": GROUP, "M": p.sizes.text(p.M), "N": p.sizes.text(p.N), "K": p.sizes.text(p.K), "ARGS": p.args,
        "FETCH": FETCH or fetch_depth(knobs, producer.regs),
        "PRODUCERS": producer.threads, "FULL_ARRIVALS": producer.threads + 1 if gathered else 1,
        "PRODUCER_REGS": producer.regs, "CONSUMER_REGS": consumer_registers(CW, producer.regs),
        "GATHERED": int(gathered), "TMA_BYTES": producer.tma_bytes, "LOAD_TMA": "{ " + producer.tma + " }",
        "TILE_SETUP": producer.tile_setup, "GATHER": producer.gather, "UNIT_COORDS": UNIT_COORDS,
        "STAGE_BLOCK": STAGE_BLOCK, **vector, "CLUSTER": CLUSTER, **_release_defines(CLUSTER, PP, CW),
        "TMA_STORE": int(out_map is not None), "KILN_PACK2(b, m, n, v0, v1)": "kiln_epilogue2_packed(ARGS, b, m, n, v0, v1)",
        "STORE_TILE(tile, x, y)": out_map[1] if out_map else "",
        "DESC_A(S, KK)": stage_desc(producer.trans_a), "DESC_B(S, KK)": stage_desc(producer.trans_b),
        **producer.defines, **sk.defines,
    }
    groups = [ptx.CP_ASYNC] * gathered + [ptx.MBARRIER, ptx.TMA] + [ptx.CLUSTER] * (CLUSTER > 1)
    source = template_source([wgmma(BN, p.dtype, producer.trans_a, producer.trans_b), producer.source,
                              sk.stores, KERNEL, sk.source], defines, p.epilogue + vector_hook, ptx=groups)
    units = int(-(-p.M // (block_m(knobs) * CLUSTER)) * -(-p.N // BN) * p.batch * SPLIT)
    launches = [Launch(kernel, args + sk.args + tuple(maps.values()), (128 * (CW + 1), 1, 1),
                       items=units * CLUSTER, per_block=1, waves=1, smem=smem_bytes(knobs, sources),
                       cluster=CLUSTER)] + sk.launches
    return CudaProgram(source, launches, temporaries, arch_suffix="a", min_arch=90, alignment=16,
                       sizes=p.sizes.values)


def output_map(p: Problem) -> tuple[TensorMapArg, str] | None:
    """The output as a tensor map of 16 x 64 boxes (128-byte swizzled) and the C of one box's
    store from shared memory `tile` at column x, row y of batch bz (`STORE_TILE`), where the
    output is 16-bit, its element (b, m, n) at b * sb + m * sm + n for fixed sizes, N even and
    the strides multiples of 16 bytes; else None."""
    o = p.output
    if (o is None or o.out.dtype.nbytes != 2 or p.sizes.values or not all(isinstance(x, int) for x in (p.M, p.N))
            or p.N % 2):
        return None
    b, m, n = Var("b", max(int(p.batch), 1)), Var("m", p.M), Var("n", p.N)
    index = o.index_of(b, m, n)
    flat = sum((index[id(a)] * s for a, s in zip(o.out.axes, row_major_strides(o.out.shape))), Const(0, dtypes.int64))
    terms, const = linear_terms(simplify(flat))
    coef = {id(t): k for t, k in terms}
    if (const or len(coef) != len(terms) or coef.get(id(n)) != 1
            or any(id(t) not in (id(b), id(m), id(n)) or not isinstance(k, int) for t, k in terms)):
        return None
    sm, sb = coef.get(id(m), 0), coef.get(id(b), 0)
    batched = p.batch > 1 and sb
    if not sm or sm * 2 % 16 or (batched and sb * 2 % 16):
        return None
    dims = (p.N, p.M) + ((int(p.batch),) if batched else ())
    strides = (1, sm) + ((sb,) if batched else ())
    arg = TensorMapArg(KernelArgs.output(0), o.out.dtype, dims, strides, (64, 16) + (1,) * (len(dims) - 2))
    return arg, f"kiln_tma_store_{len(dims)}d(&tmO, tile, x, y{', (int)bz' if batched else ''})"


def _release_defines(cluster: int, pp: int, cw: int) -> dict:
    """EMPTY_ARRIVALS and RELEASE(bar), a consumer's release of a ring slot: one arrival per
    thread, or in a cluster one per warp on the slot's barrier in each CTA (both CTAs' producers
    fill it)."""
    consumers = 128 * (1 if pp else cw)
    if cluster == 1:
        return {"EMPTY_ARRIVALS": consumers, "RELEASE(bar)": "kiln_bar_arrive(bar)"}
    return {"EMPTY_ARRIVALS": consumers // 32 * cluster,
            "RELEASE(bar)": "if (lane == 0) { kiln_bar_arrive(bar); kiln_bar_arrive_cta(bar, rank ^ 1); }"}


def _source_maps(sources: tuple[EpilogueSource, ...], M: int, N: int, bm: int, bn: int) -> dict[str, TensorMapArg]:
    """Tensor maps S0, S1, .. of the sources as M x N matrices, a box a bm x bn tile (unswizzled)."""
    return {f"S{k}": TensorMapArg(s.param, s.dtype, (int(N), int(M)), (1, int(s.row_stride)), (bn, bm), swizzle=0)
            for k, s in enumerate(sources)}


def _source_defines(sources: tuple[EpilogueSource, ...], knobs: dict, split: int) -> dict:
    """NSRC, SRC_BYTES (one buffer), LOAD_SOURCES (thread 0's copies into buffer sb),
    SOURCE_TILES (the tiles of buffer sb, as the hooks take them) and KILN_FETCH_AT(b, m, n, f,
    at): the epilogue's per-row loads, from tile element `at` of buffer sb where staged (none
    where K is `split`)."""
    if not sources:
        # a split K's stores fetch nothing (the epilogue runs in the sum kernel): no call at all,
        # which would make the fetching lambda capture the kernel's arguments
        fetch = "((void)0)" if split > 1 else "kiln_store_fetch2(KERNEL_ARGS, b, m, n, f)"
        return {"NSRC": 0, "SRC_BYTES": 0, "KILN_FETCH_AT(b, m, n, f, at)": fetch}
    offsets = [source_bytes(knobs, sources[:k]) for k in range(len(sources))]
    tile = lambda k, s: f"(const {CudaDialect().storage_type(s.dtype)}*)(srcs + sb * SRC_BYTES + {offsets[k]})"
    return {"NSRC": len(sources), "SRC_BYTES": source_bytes(knobs, sources),
            "LOAD_SOURCES": " ".join(f"kiln_tma_2d(srcs + sb * SRC_BYTES + {offsets[k]}, &tmS{k}, &src_full[sb], "
                                     "(int)n0, (int)m0);" for k in range(len(sources))),
            "SOURCE_TILES": ", ".join(tile(k, s) for k, s in enumerate(sources)),
            "KILN_FETCH_AT(b, m, n, f, at)": "kiln_fetch2_staged(ARGS, b, m, n, f, at, SOURCE_TILES)"}


def _vector_epilogue(p: Problem, split: int, sources: tuple[EpilogueSource, ...]) -> tuple[dict, str]:
    """(defines, hook source) of the epilogue: VEC = 16 bytes of outputs per lane through
    `kiln_epilogue_v` where the output stores such packs (`vector_stores`) and nothing is split,
    else VEC = 0 (pairs through `kiln_epilogue2`)."""
    o = p.output
    vec = 16 // o.out.dtype.nbytes if o is not None and o.out.dtype.nbytes in (2, 4) else 0
    if split > 1 or not vec or not vector_stores(o.out, o.index_of, vec, o.extents):
        return {"VEC": 0}, ""
    store = f"kiln_epilogue_v(ARGS, b, m, n, v{', at, SOURCE_TILES' if sources else ''})"
    return ({"VEC": vec, "KILN_STORE_V(b, m, n, v, at)": store},
            render_vector_epilogue(o.lowered, o.out, o.decl, o.index_of, vec, o.extents, o.sizes, sources))
