"""GEMM-shaped tasks on the CPU in the BLIS style: matmul, batched matmul, linear and
convolution (implicit GEMM), float32 accumulation of float32/float16/bfloat16 operands.

The task is seen as batched GEMMs through the C hooks of `cpu_hooks` (so any operand strides,
transposes, 16-bit inputs and convolution windows are the hooks' business). The threads split
N (or M, where N has too few panels) in whole panels and never wait on each other: each cuts
its share into NC-wide, KC-deep and MC-tall blocks, packs a KC x NC block of B into NR-wide
k-major panels (row by row along n, or, where B is contiguous in k, in runs along k transposed
VW x VW in registers) and an MC x KC block of A into MR-tall panels, both zero-padded to whole
panels, and runs the
register-blocked micro-kernel over the block's MR x NR tiles (B panels outer, so a B panel
stays in L1 while A's panels stream from L2). The micro-kernel uses GCC vector extensions on
the host's widest vectors (`cpu_simd`; AVX-512: 14, 12 or 8 x 32 by M's last panel, AVX2:
6 x 16, else 128-bit 8 x 8). A tile is added into a float32 workspace (K blocks before the
last; K up to WHOLE_K is one block) or handed to the epilogue hook, which applies whatever
fusion put there (bias, activation, residual, cast) and stores.

A B that is one input, the same for every batch (a weight), may be laid out once when it is a
constant of the graph (`kiln.runtime.cpu.Preparation`): `kiln_prepare` packs all of its panels,
K deep, and `kiln_kernel_prepared` reads them in place of packing B per block.

With at most SMALL_M rows (grouped convolutions, vector-matrix products) nothing is packed:
rows of B are scaled into the accumulators, or, for B contiguous in k, dot products are taken;
B's panels laid out once are streamed once.

The C comes in pieces that other CPU templates reuse (`conv_cpu`): HELPERS, MICRO (the
micro-kernel; with A_DIRECT defined to 1 it reads row k of an A panel in place at
a + aoff[k], through the template's `kiln_a_rows` and `kiln_a_offsets`), PACK_A,
BLOCK (B's packing, the blocks of one thread, `kiln_gemm`: the threads' split, reading B's
panels from `bpre` where they were laid out once; a finished tile goes to `kiln_store_tile`,
which PACK_A defines as rows through the epilogue hook; `kiln_pack_panels`, the layout), FEW_ROWS
with the kernel, and the exported functions of `entry_points`.

Symbolic sizes are kernel arguments (`kiln.codegen.sizes`): BATCH, M, N and K are macros of
them, so one build serves every size.
"""
from __future__ import annotations

from kiln.template import C_PRELUDE, CpuProgram, KernelArgs, Preparation, SymSize, Template

from kiln_ops_builtin.templates.cpu_hooks import match_cpu_gemm
from kiln_ops_builtin.templates.cpu_simd import VECTORS

HELPERS = r"""
#include <omp.h>
#define KILN_MIN(a, b) ((a) < (b) ? (a) : (b))
#define KILN_PANELS(x, w) (((x) + (w) - 1) / (w))
/* 64-byte aligned (aligned_alloc wants a size that is a multiple of the alignment) */
static inline float* kiln_alloc(int64_t floats) { return (float*)aligned_alloc(64, (size_t)(floats * 4 + 127) / 64 * 64); }
"""

MICRO = r"""
#define NV 2
#define NR (NV * VW)
#ifndef MR
#if VW == 16
#define MR MR_WIDE
#elif VW == 8
#define MR 6
#else
#define MR 8
#endif
#endif
#define MCB (MC / MR * MR)          /* A's blocks in whole panels */
#ifndef A_DIRECT
#define A_DIRECT 0
#endif
/* cout[MR][NR] (row stride ldout) = cin (row stride ldin; zeros where NULL) + a-panel (kc x MR,
   k-major; or, where A_DIRECT, row k at a + aoff[k]: A read in place) times b-panel (kc x NR,
   k-major) */
static inline void kiln_micro(int64_t kc, const float* __restrict__ a, const int64_t* __restrict__ aoff,
                              const float* __restrict__ b,
                              const float* cin, int64_t ldin, float* cout, int64_t ldout) {
    kiln_vf acc[MR][NV];
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
        for (int j = 0; j < NV; ++j) acc[i][j] = cin ? *(const kiln_vfu*)(cin + i * ldin + j * VW) : (kiln_vf){0};
    for (int64_t k = 0; k < kc; ++k) {
        kiln_vf bv[NV];
#pragma GCC unroll 4
        for (int j = 0; j < NV; ++j) bv[j] = *(const kiln_vfu*)(b + k * NR + j * VW);
#pragma GCC unroll 16
        for (int i = 0; i < MR; ++i) {
            const float av = A_DIRECT ? a[aoff[k] + i] : a[k * MR + i];
#pragma GCC unroll 4
            for (int j = 0; j < NV; ++j) acc[i][j] += av * bv[j];
        }
    }
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
        for (int j = 0; j < NV; ++j) *(kiln_vfu*)(cout + i * ldout + j * VW) = acc[i][j];
}
"""

PACK_A = r"""
static void kiln_pack_a(PARAMS, int64_t b, int64_t m0, int64_t rows, int64_t k0, int64_t kc,
                        float* __restrict__ dst) {
    for (int64_t k = 0; k < kc; ++k)
        for (int64_t i = 0; i < MR; ++i)
            dst[k * MR + i] = i < rows ? kiln_a(ARGS, b, m0 + i, k0 + k) : 0.f;
}

/* a finished tile: its rows through the epilogue hook */
static inline void kiln_store_tile(PARAMS, int64_t b, int64_t m0, int64_t n0, int64_t rows, int64_t cols,
                                   const float* __restrict__ tile) {
    for (int64_t i = 0; i < rows; ++i) kiln_epilogue_row(ARGS, b, m0 + i, n0, cols, tile + i * NR);
}
"""

BLOCK = r"""
static void kiln_pack_b(PARAMS, int64_t b, int64_t n0, int64_t cols, int64_t k0, int64_t kc,
                        float* __restrict__ dst) {
#if B_BY_K
        /* runs of `ch` k of VW columns copied contiguous, then transposed VW x VW in registers;
           the k that no run covers one by one */
        int64_t k = 0;
        for (int64_t ch = 64; ch >= VW; ch /= 4)
            for (; k + ch <= kc; k += ch)
                for (int64_t g = 0; g < NV; ++g) {
                    float run[VW * 64] __attribute__((aligned(64)));
                    for (int64_t j = 0; j < VW; ++j) {
                        if (g * VW + j < cols) kiln_b_col(ARGS, b, n0 + g * VW + j, k0 + k, ch, run + j * ch, 1);
                        else for (int64_t e = 0; e < ch; ++e) run[j * ch + e] = 0.f;
                    }
                    for (int64_t s = 0; s < ch; s += VW) {
                        kiln_vf r[VW];
                        for (int64_t j = 0; j < VW; ++j) r[j] = *(const kiln_vf*)(run + j * ch + s);
                        kiln_vtranspose(r);
                        for (int64_t i = 0; i < VW; ++i) *(kiln_vf*)(dst + (k + s + i) * NR + g * VW) = r[i];
                    }
                }
        for (int64_t j = 0; j < cols; ++j) kiln_b_col(ARGS, b, n0 + j, k0 + k, kc - k, dst + k * NR + j, NR);
        for (int64_t e = k; e < kc; ++e)
            for (int64_t j = cols; j < NR; ++j) dst[e * NR + j] = 0.f;
#else
    for (int64_t k = 0; k < kc; ++k) {
        kiln_b_row(ARGS, b, k0 + k, n0, cols, dst + k * NR);
        for (int64_t j = cols; j < NR; ++j) dst[k * NR + j] = 0.f;
    }
#endif
}

#define SMALL_M 4
#define CHUNK 512
#ifndef B_GROUPS
#define B_GROUPS 1          /* the different Bs of the batches (see kiln_pack_panels) */
#endif

/* the tiles of panels [m_lo, m_hi) x [n_lo, n_hi) of batch b, on one thread with its own
   packing buffers */
static void kiln_block(PARAMS, int64_t b, int64_t m_lo, int64_t m_hi, int64_t n_lo, int64_t n_hi,
                       float* __restrict__ apack, float* __restrict__ bpack, float* __restrict__ ws) {
    for (int64_t jc = n_lo; jc < n_hi; jc += NC)
    for (int64_t pc = 0; pc < K; pc += KC) {
        const int64_t nc = KILN_MIN(NC, n_hi - jc), kc = KILN_MIN(KC, K - pc);
        const int64_t npanels = KILN_PANELS(nc, NR);
        const int first = pc == 0, last = pc + kc >= K;
        for (int64_t p = 0; p < npanels && !bpre; ++p)
            kiln_pack_b(ARGS, b, jc + p * NR, KILN_MIN(NR, N - jc - p * NR), pc, kc, bpack + p * NR * kc);
        /* B's panels: packed here (panel p at p * NR * kc) or laid out once (jc is whole panels) */
        const float* const bpanels = bpre ? bpre + b % B_GROUPS * KILN_PANELS(N, NR) * NR * K + jc * K + pc * NR : bpack;
        const int64_t bstride = bpre ? NR * K : NR * kc;
        for (int64_t ic = m_lo; ic < m_hi; ic += MCB) {
            const int64_t mc = KILN_MIN(MCB, m_hi - ic), mpanels = KILN_PANELS(mc, MR);
            for (int64_t p = 0; p < mpanels && !A_DIRECT; ++p)
                kiln_pack_a(ARGS, b, ic + p * MR, KILN_MIN(MR, M - ic - p * MR), pc, kc, apack + p * MR * kc);
            for (int64_t jp = 0; jp < npanels; ++jp)
                for (int64_t ip = 0; ip < mpanels; ++ip) {
                    float tile[MR * NR] __attribute__((aligned(64)));
                    const int64_t m0 = ic + ip * MR, n0 = jc + jp * NR;
                    const int64_t rows = KILN_MIN(MR, M - m0), cols = KILN_MIN(NR, N - n0);
                    const int full = rows == MR && cols == NR;
                    float* w = ws + (full ? m0 * N + n0 : 0);
                    if (!first && !full)
                        for (int64_t i = 0; i < rows; ++i)
                            for (int64_t j = 0; j < cols; ++j) tile[i * NR + j] = ws[(m0 + i) * N + n0 + j];
                    const float* cin = first ? NULL : full ? w : tile;
                    const int to_ws = full && !last;
#if A_DIRECT
                    kiln_micro(kc, kiln_a_rows(ARGS, b, m0), kiln_a_offsets(ARGS, pc), bpanels + jp * bstride, cin, full ? N : NR,
#else
                    kiln_micro(kc, apack + ip * MR * kc, NULL, bpanels + jp * bstride, cin, full ? N : NR,
#endif
                               to_ws ? w : tile, to_ws ? N : NR);
                    if (last)
                        kiln_store_tile(ARGS, b, m0, n0, rows, cols, tile);
                    else if (!full)
                        for (int64_t i = 0; i < rows; ++i)
                            for (int64_t j = 0; j < cols; ++j) ws[(m0 + i) * N + n0 + j] = tile[i * NR + j];
                }
        }
    }
}

/* Threads split N (or M, where N has too few panels) in whole panels and never wait on each
   other: each packs its own operand blocks (B's only where bpre, B laid out once, is NULL). */
static void kiln_gemm(PARAMS) {
    const int64_t kcap = KILN_MIN(KC, K);
    float* ws = K > KC ? (float*)malloc((size_t)M * N * 4) : NULL;
    const int threads = (double)BATCH * M * N * K > 65536.0 ? omp_get_max_threads() : 1;
#pragma omp parallel num_threads(threads)
    {
        const int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
        const int split_n = KILN_PANELS(N, NR) >= 4 * T || N >= M;
        const int64_t panels = split_n ? KILN_PANELS(N, NR) : KILN_PANELS(M, MR);
        const int64_t width = split_n ? NR : MR, extent = split_n ? N : M;
        const int64_t lo = KILN_MIN(panels * t / T * width, extent), hi = KILN_MIN(panels * (t + 1) / T * width, extent);
        float* bpack = bpre ? NULL : kiln_alloc(KILN_PANELS(KILN_MIN(NC, N), NR) * NR * kcap);
        float* apack = kiln_alloc(KILN_PANELS(KILN_MIN(MCB, M), MR) * MR * kcap);
        if (lo < hi)
            for (int64_t b = 0; b < BATCH; ++b) {
                if (split_n) kiln_block(ARGS, b, 0, M, lo, hi, apack, bpack, ws);
                else kiln_block(ARGS, b, lo, hi, 0, N, apack, bpack, ws);
            }
        free(apack);
        free(bpack);
    }
    free(ws);
}

/* B's panels for every n and k, laid out once where B is a constant (the kernels' bpre): as
   kiln_pack_b packs them, K deep, panel p at p * NR * K, for each of the B_GROUPS different Bs
   (batch b reads the (b % B_GROUPS)-th: a grouped convolution's groups). Returns their floats;
   writes them to dst unless it is NULL. */
static int64_t kiln_pack_panels(PARAMS, float* dst) {
    const int64_t panels = KILN_PANELS(N, NR);
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t b = 0; b < (dst ? B_GROUPS : 0); ++b)
        for (int64_t p = 0; p < panels; ++p)
            kiln_pack_b(ARGS, b, p * NR, KILN_MIN(NR, N - p * NR), 0, K, dst + (b * panels + p) * NR * K);
    return B_GROUPS * panels * NR * K;
}
"""

FEW_ROWS = r"""
/* Few rows (M <= SMALL_M: depthwise convolutions, vector-matrix products): no packing; each
   chunk of a B row, made once per k, is scaled into the M accumulator rows. */
static void kiln_few_rows(PARAMS, int threads) {
    const int64_t chunks = KILN_PANELS(N, CHUNK);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t u = 0; u < BATCH * chunks; ++u) {
        const int64_t b = u / chunks, n0 = u % chunks * CHUNK, count = KILN_MIN(CHUNK, N - n0);
        float acc[M][CHUNK] __attribute__((aligned(64)));
        float row[CHUNK] __attribute__((aligned(64)));
        for (int64_t m = 0; m < M; ++m)
            for (int64_t j = 0; j < CHUNK; ++j) acc[m][j] = 0.f;
        for (int64_t k = 0; k < K; ++k) {
            kiln_b_row(ARGS, b, k, n0, count, row);
            for (int64_t m = 0; m < M; ++m) {
                const float a = kiln_a(ARGS, b, m, k);
                for (int64_t j = 0; j < count; ++j) acc[m][j] += a * row[j];
            }
        }
        for (int64_t m = 0; m < M; ++m) kiln_epilogue_row(ARGS, b, m, n0, count, acc[m]);
    }
}

/* Few rows with B read along k (vector-matrix products with a linear layer's weight): dot
   products of A's rows with B's columns, each column copied once into a contiguous buffer. */
static void kiln_few_rows_by_k(PARAMS, int threads) {
    const int64_t chunks = KILN_PANELS(N, CHUNK);
#pragma omp parallel num_threads(threads)
    {
        float* arows = kiln_alloc(M * K);
        float* col = kiln_alloc(K);
        int64_t loaded = -1;
#pragma omp for schedule(static)
        for (int64_t u = 0; u < BATCH * chunks; ++u) {
            const int64_t b = u / chunks, n0 = u % chunks * CHUNK, count = KILN_MIN(CHUNK, N - n0);
            float acc[M][CHUNK] __attribute__((aligned(64)));
            if (b != loaded) {
                for (int64_t m = 0; m < M; ++m)
                    for (int64_t k = 0; k < K; ++k) arows[m * K + k] = kiln_a(ARGS, b, m, k);
                loaded = b;
            }
            for (int64_t j = 0; j < count; ++j) {
                kiln_b_col(ARGS, b, n0 + j, 0, K, col, 1);
                for (int64_t m = 0; m < M; ++m) {
                    const float* a = arows + m * K;
                    kiln_vf sum = (kiln_vf){0};
                    int64_t k = 0;
                    for (; k + VW <= K; k += VW) sum += *(const kiln_vfu*)(a + k) * *(const kiln_vfu*)(col + k);
                    float total = 0.f;
                    for (int e = 0; e < VW; ++e) total += sum[e];
                    for (; k < K; ++k) total += a[k] * col[k];
                    acc[m][j] = total;
                }
            }
            for (int64_t m = 0; m < M; ++m) kiln_epilogue_row(ARGS, b, m, n0, count, acc[m]);
        }
        free(col);
        free(arows);
    }
}

/* Few rows with B laid out once (bpre): each panel streamed once, A's rows (gathered once per
   batch) broadcast into the panel's NV vectors per row. */
static void kiln_few_rows_panels(PARAMS, int threads) {
    const int64_t panels = KILN_PANELS(N, NR);
#pragma omp parallel num_threads(threads)
    {
        float* arows = kiln_alloc(M * K);
        int64_t loaded = -1;
#pragma omp for schedule(static)
        for (int64_t u = 0; u < BATCH * panels; ++u) {
            const int64_t b = u / panels, n0 = u % panels * NR;
            const float* __restrict__ panel = bpre + n0 * K;
            kiln_vf acc[SMALL_M][NV];
            if (b != loaded) {
                for (int64_t m = 0; m < M; ++m)
                    for (int64_t k = 0; k < K; ++k) arows[m * K + k] = kiln_a(ARGS, b, m, k);
                loaded = b;
            }
            for (int64_t m = 0; m < SMALL_M; ++m)
                for (int j = 0; j < NV; ++j) acc[m][j] = (kiln_vf){0};
            for (int64_t k = 0; k < K; ++k)
                for (int64_t m = 0; m < M; ++m) {
                    const float a = arows[m * K + k];
#pragma GCC unroll 4
                    for (int j = 0; j < NV; ++j) acc[m][j] += a * *(const kiln_vfu*)(panel + k * NR + j * VW);
                }
            for (int64_t m = 0; m < M; ++m) {
                float row[NR] __attribute__((aligned(64)));
                for (int j = 0; j < NV; ++j) *(kiln_vf*)(row + j * VW) = acc[m][j];
                kiln_epilogue_row(ARGS, b, m, n0, KILN_MIN(NR, N - n0), row);
            }
        }
        free(arows);
    }
}

static void kiln_main(PARAMS) {
    if (M <= SMALL_M) {
        const int threads = (double)BATCH * M * N * K > 65536.0 ? omp_get_max_threads() : 1;
        if (bpre) kiln_few_rows_panels(ARGS, threads);
        else if (B_BY_K) kiln_few_rows_by_k(ARGS, threads);
        else kiln_few_rows(ARGS, threads);
        return;
    }
    kiln_gemm(ARGS);
}
"""
KERNEL = HELPERS + MICRO + PACK_A + BLOCK + FEW_ROWS

DEFAULT = {"MC": 336, "KC": 256, "NC": 4096, "WHOLE_K": 768}
WIDE_ROWS = (14, 12, 8)     # register-tile heights with 16-float vectors


def row_tile(m: int, heights=WIDE_ROWS) -> int:
    """The register-tile height for M = m rows: the one of `heights` that pads m's last panel
    least, the tallest of those tied (M = 128 takes 8: 14 would compute 140 rows)."""
    return min(heights, key=lambda r: (-(-m // r) * r - m, -r))


def applies(task) -> bool:
    """Sums of products with at least one term (an empty sum, K = 0, is the auto-scheduler's)."""
    g = match_cpu_gemm(task)
    return g is not None and g.K > 0


def render(task, MC: int, KC: int, NC: int, WHOLE_K: int = 0, MR: int = 0) -> CpuProgram:
    """The program `kiln_kernel(inputs..., output)` for `task`. K up to WHOLE_K is one block (no
    float32 workspace between K blocks, which costs most where M x N outgrows the L2 cache);
    MR = 0 takes the ISA's default (`row_tile` of M with 16-float vectors)."""
    g = match_cpu_gemm(task)
    if g is None:
        raise ValueError(f"gemm_cpu does not apply to task '{task.name}'")
    extents = {name: g.text(value) for name, value in (("BATCH", g.batch), ("M", g.M), ("N", g.N), ("K", g.K))}
    fixed = lambda size: not isinstance(size, SymSize)        # a symbolic size's choice would differ by size
    args, sizes, size_args = KernelArgs.args(len(task.inputs)), g.sizes.declarations(), g.sizes.names
    defines = {"PARAMS": ", ".join(g.buffers + [BPRE] + sizes), "ARGS": ", ".join(args + ["bpre"] + size_args),
               **extents, "MC": MC, "KC": g.K if fixed(g.K) and g.K <= WHOLE_K else KC, "NC": NC,
               "B_BY_K": int(g.b_by_k), "MR_WIDE": row_tile(g.M) if fixed(g.M) else WIDE_ROWS[0],
               **({"MR": MR} if MR else {})}
    head = "".join(f"#define {name} {value}\n" for name, value in defines.items())
    entries = entry_points(g.buffers, args, sizes, size_args, "kiln_main", "kiln_pack_panels")
    return CpuProgram(C_PRELUDE + VECTORS + head + g.hooks + KERNEL + entries, "kiln_kernel", tuple(args),
                      sizes=g.sizes.values, preparation=preparation(g.b_input, len(task.inputs)))


BPRE = "const float* __restrict__ bpre"


def entry_points(buffers: list[str], args: list[str], sizes: list[str], size_args: list[str], main: str,
                 prepare: str) -> str:
    """C of a GEMM program's exported functions (buffer parameters `buffers` named `args`, size
    parameters `sizes` named `size_args`) around `main(<buffers>, bpre, <sizes>)`, the kernel,
    which reads B's panels laid out once from bpre or packs them itself where bpre is NULL, and
    `prepare(<buffers>, bpre, <sizes>, dst)`, which lays them out (`kiln_pack_panels`):
    `kiln_kernel` (bpre NULL), `kiln_kernel_prepared` (bpre after the buffers) and
    `kiln_prepare` (see `preparation`)."""
    plain = ", ".join(buffers + sizes)
    call = lambda bpre: ", ".join(args + [bpre] + size_args)
    return (f"void kiln_kernel({plain}) {{ {main}({call('NULL')}); }}\n"
            f"void kiln_kernel_prepared({', '.join(buffers + [BPRE] + sizes)}) {{ {main}({call('bpre')}); }}\n"
            f"int64_t kiln_prepare({plain}, float* dst) {{ return {prepare}({call('NULL')}, dst); }}\n")


def preparation(b_input: int | None, inputs: int) -> Preparation | None:
    """How a program of `entry_points` with `inputs` inputs lays out input `b_input`, its B,
    where that is a constant (None: no input may be)."""
    if b_input is None:
        return None
    return Preparation(b_input, "kiln_prepare", "kiln_kernel_prepared",
                       (*KernelArgs.args(inputs), KernelArgs.input(inputs)))


def space(level: int) -> list[dict]:
    """Level 0: the default blocking; higher levels add a shallower and a deeper K block."""
    knobs = [dict(DEFAULT)]
    if level >= 1:
        knobs += [{**DEFAULT, "KC": 128}, {**DEFAULT, "KC": 384, "MC": 224}]
    return knobs


MATMUL = Template("gemm_cpu", ("matmul", "linear"), "cpu", render, priority=10, applies=applies, space=space,
                  symbolic=True)
CONV = Template("conv_gemm_cpu", ("conv1d", "conv2d"), "cpu", render, priority=10, applies=applies, space=space,
                symbolic=True)
