"""GEMM-shaped tasks in float32 on the CUDA cores (no TF32): matmul, batched matmul, linear,
and convolutions as implicit GEMM.

A block of 256 threads (8 warps) computes a BM x BN output tile; each warp a WM x WN part of
it, and each thread of a warp a TM x TN sub-tile made of 4-row x 4-column pieces spread over
the warp's tile (the lanes form a 4 x 8 grid, or 8 x 4 where WM > WN), so that the 16-byte
shared-memory reads of a k-step are broadcasts of at most 128 distinct bytes: free of bank
conflicts. K advances BK at a time (over a share of K with split-K,
`kiln_ops_builtin.templates.split_k`) through a ring of STAGES shared-memory stages, one
`__syncthreads` a k-tile: while k-tile t is multiplied, the copies of t + STAGES - 1 are in
flight (cp.async groups, waited `STAGES - 2` deep; a register-staged operand holds one k-tile
in registers across the FMAs and stores it into its stage after them). With FRAG, each thread
reads the next k-step's fragments (its float4s of A and B) into a second register set while
the current k-step's FMAs run, the first k-step of the next k-tile included (read right after
the barrier, before the last k-step's FMAs). With FRAG the 128 x 128 tile keeps two blocks an
SM (128 registers, no spills, 2 to 4 stages, ptxas for sm_90), without it three stages spill
16 bytes. Shared memory is static, at most 48 KB (`render` refuses more), so 128 x 128 x 16
tiles take two stages. Both operands are stored k-major in shared memory, rows padded by 4 floats; an operand that is k-contiguous in
memory (A, or B of `linear`) is read into registers (float4s along k where sizes allow) and
transposed on the way in, the padding keeping those stores free of bank conflicts; an operand
contiguous along m or n is copied by `cp.async` straight into shared memory when ASYNC (else
through registers too). Each thread's copies walk their operand by pointers that advance a
k-tile at a time, the 64-bit offsets computed once. Tiles are handed out in groups of
GROUP_M rows of tiles, so that blocks running together share their operands in L2.

A convolution's operands are read through the core's load hooks
(`kiln.codegen.hooks.match_hooked_gemm`: im2col computed on the fly, padding included), a
scalar at a time. Outputs go through the core's epilogue hook.

Symbolic sizes (`Template.symbolic`): M, N, K, strides and batch dims are kernel arguments
(`Contraction.sizes`, `HookedGemm.sizes`); `suggest` buckets them by powers of two
(`split_k.bucket`), so the sizes of a bucket share one source.
"""
from __future__ import annotations

from kiln.template import (Contraction, CudaProgram, HookedGemm, Launch, Operand, Template, dtypes, match_contraction,
                           match_hooked_gemm, ptx, template_source)
from kiln_ops_builtin.templates import split_k

NT = 256
KNOBS = ("BM", "BN", "BK", "WM", "WN", "MIN_BLOCKS", "ASYNC", "STAGES", "FRAG")
MAX_SMEM = 48 * 1024

COPIES = r"""
template <int W> struct kiln_vec { typedef float4 type; };
template <> struct kiln_vec<1> { typedef float type; };
static __device__ __forceinline__ float kiln_part(float v, int) { return v; }
static __device__ __forceinline__ float kiln_part(const float4& v, int e) {
    return e == 0 ? v.x : e == 1 ? v.y : e == 2 ? v.z : v.w;
}
static __device__ __forceinline__ void kiln_zero(float& v) { v = 0.f; }
static __device__ __forceinline__ void kiln_zero(float4& v) { v = make_float4(0.f, 0.f, 0.f, 0.f); }

// A thread's share of the copies of one operand's k-tile (BX x BK elements, stored k-major in
// shared memory, rows of BX + 4): L copies of W elements along the operand's contiguous
// dimension (k when KC, else x), copy i starting at tile element `slot(i)`. A k-contiguous
// operand copied as float4s gives each warp 16 rows x 2 float4s of k: whole 32-byte sectors
// of global memory, and transposed stores that the padding keeps free of bank conflicts.
template <int BX, int KC, int W>
struct kiln_tile_copy {
    static constexpr int COPIES = BX * BK / W, L = (COPIES + 255) / 256;
    typedef typename kiln_vec<W>::type T;
    T v[L];
    // (x, k) of copy i (a function of threadIdx.x, left to the compiler to keep or recompute)
    static __device__ __forceinline__ int2 slot(int i) {
        const int idx = threadIdx.x + i * 256;
        if constexpr (KC && W == 4) {
            const int c = idx / 32, l = idx % 32;
            return make_int2(l / 2 + 16 * (c / (BK / 8)), (l % 2 + 2 * (c % (BK / 8))) * 4);
        } else if constexpr (KC) {
            return make_int2(idx / BK, idx % BK);
        } else {
            return make_int2(idx % (BX / W) * W, idx / (BX / W));
        }
    }
    static __device__ __forceinline__ bool live(int i) { return COPIES % 256 == 0 || threadIdx.x + i * 256 < COPIES; }
    // the registers of the last fetch into buffer s
    __device__ __forceinline__ void stash(float (*s)[BX + 4]) const {
#pragma unroll
        for (int i = 0; i < L; ++i) {
            if (!live(i)) continue;
            const int2 at = slot(i);
            if constexpr (!KC && W == 4) {
                *(float4*)&s[at.y][at.x] = v[i];
            } else {
#pragma unroll
                for (int e = 0; e < W; ++e) {
                    if (KC) s[at.y + e][at.x] = kiln_part(v[i], e);
                    else s[at.y][at.x + e] = kiln_part(v[i], e);
                }
            }
        }
    }
};

// An operand in memory: element (x, k) at base[x * XS + k * KS], x < X and k < KE. The copies'
// pointers start at the block's first k-tile and advance a k-tile per fetch; `fetch` and
// `async` take the k-tiles in order, k0 being the first k of the one they copy.
template <int BX, int KC, int W>
struct kiln_plain_copy : kiln_tile_copy<BX, KC, W> {
    typedef kiln_tile_copy<BX, KC, W> S;
    const float* p[S::L];
    const float* base;
    bool in[S::L];
    int64_t step, ke;
    __device__ __forceinline__ kiln_plain_copy(const float* b, int64_t x0, int64_t X, int64_t XS, int64_t KS,
                                               int64_t KE, int64_t k0) : base(b), step(BK * KS), ke(KE) {
#pragma unroll
        for (int i = 0; i < S::L; ++i) {
            const int2 at = S::slot(i);
            p[i] = b + (x0 + at.x) * XS + (k0 + at.y) * KS;
            in[i] = x0 + at.x < X;
        }
    }
    __device__ __forceinline__ void fetch(int64_t k0) {
#pragma unroll
        for (int i = 0; i < S::L; ++i) {
            if (!this->live(i)) continue;
            if (in[i] && k0 + S::slot(i).y < ke) this->v[i] = *(const typename S::T*)p[i];
            else kiln_zero(this->v[i]);
            p[i] += step;
        }
    }
#if A_ASYNC || B_ASYNC
    // fetch's copies (W = 4, not KC) straight into buffer s, zero-filled out of bounds
    __device__ __forceinline__ void async(float (*s)[BX + 4], int64_t k0) {
#pragma unroll
        for (int i = 0; i < S::L; ++i) {
            if (!this->live(i)) continue;
            const int2 at = S::slot(i);
            const bool ok = in[i] && k0 + at.y < ke;
            kiln_cp_async16(&s[at.y][at.x], ok ? p[i] : base, ok ? 16 : 0);
            p[i] += step;
        }
    }
#endif
};

// An operand read through a load hook, load(x, k) for x0 + x < X and k < KE, a scalar at a time
template <int BX, int KC, class F>
struct kiln_hooked_copy : kiln_tile_copy<BX, KC, 1> {
    typedef kiln_tile_copy<BX, KC, 1> S;
    F load;
    int64_t x0, X, ke;
    __device__ __forceinline__ kiln_hooked_copy(F f, int64_t x0_, int64_t X_, int64_t KE)
        : load(f), x0(x0_), X(X_), ke(KE) {}
    __device__ __forceinline__ void fetch(int64_t k0) {
#pragma unroll
        for (int i = 0; i < S::L; ++i) {
            if (!this->live(i)) continue;
            const int2 at = S::slot(i);
            const int64_t gx = x0 + at.x, gk = k0 + at.y;
            this->v[i] = gx < X && gk < ke ? load(gx, gk) : 0.f;
        }
    }
};
"""

KERNEL = r"""
extern "C" __global__ void __launch_bounds__(256, MIN_BLOCKS) kiln_matmul_simt(PARAMS) {
    __shared__ __align__(16) float As[STAGES][BK][BM + 4];
    __shared__ __align__(16) float Bs[STAGES][BK][BN + 4];
    const int tid = threadIdx.x;
    const int tiles_m = (int)((M + BM - 1) / BM), tiles_n = (int)((N + BN - 1) / BN);
    const int group = blockIdx.x / (GROUP_M * tiles_n), first = group * GROUP_M;
    const int rows = min(tiles_m - first, GROUP_M), r = blockIdx.x % (GROUP_M * tiles_n);
    const int64_t m0 = (int64_t)(first + r % rows) * BM, n0 = (int64_t)(r / rows) * BN;
    const int64_t bz = blockIdx.z;
    const int KT0 = blockIdx.y * KT_SPLIT, KT = min((int)((K + BK - 1) / BK) - KT0, KT_SPLIT);
#if HOOKS
    auto load_a = [&](int64_t x, int64_t k) { return LOAD_A(x, k); };
    auto load_b = [&](int64_t x, int64_t k) { return LOAD_B(x, k); };
    kiln_hooked_copy<BM, 0, decltype(load_a)> ca(load_a, m0, M, K);
    kiln_hooked_copy<BN, 1, decltype(load_b)> cb(load_b, n0, N, K);
#else
    const int64_t k_first = (int64_t)KT0 * BK;
    kiln_plain_copy<BM, A_K_CONTIGUOUS, A_W> ca(A_PARAM + (A_BATCH), m0, M, A_XS, A_KS, K, k_first);
    kiln_plain_copy<BN, B_K_CONTIGUOUS, B_W> cb(B_PARAM + (B_BATCH), n0, N, B_XS, B_KS, K, k_first);
#endif
    // k-tile kt (of this split) into stage s: A_ASYNC/B_ASYNC copies land there by cp.async (one
    // group a k-tile), the others wait in registers for KILN_STASH
#if A_ASYNC
#define KILN_FETCH_A(kt, s) ca.async(As[s], (int64_t)(KT0 + (kt)) * BK)
#define KILN_STASH_A(s) ((void)0)
#else
#define KILN_FETCH_A(kt, s) ca.fetch((int64_t)(KT0 + (kt)) * BK)
#define KILN_STASH_A(s) ca.stash(As[s])
#endif
#if B_ASYNC
#define KILN_FETCH_B(kt, s) cb.async(Bs[s], (int64_t)(KT0 + (kt)) * BK)
#define KILN_STASH_B(s) ((void)0)
#else
#define KILN_FETCH_B(kt, s) cb.fetch((int64_t)(KT0 + (kt)) * BK)
#define KILN_STASH_B(s) cb.stash(Bs[s])
#endif
#if A_ASYNC || B_ASYNC
#define KILN_COMMIT() kiln_cp_async_commit()
#define KILN_LANDED() kiln_cp_async_wait<STAGES - 2>()
#else
#define KILN_COMMIT() ((void)0)
#define KILN_LANDED() ((void)0)
#endif
    // lanes form an LM x LN grid over the warp's WM x WN tile; a thread's pieces lie 4 * LM
    // rows and 4 * LN columns apart
    const int warp = tid / 32, lane = tid % 32;
    const int wm = warp / (BN / WN) * WM + lane / LN * 4, wn = warp % (BN / WN) * WN + lane % LN * 4;
    float acc[TM][TN];
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j) acc[i][j] = 0.f;
    // k-tiles 0 to STAGES - 2 into their stages; k-tile kt is in stage kt % STAGES
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < KT) {
            KILN_FETCH_A(s, s);
            KILN_FETCH_B(s, s);
            KILN_STASH_A(s);
            KILN_STASH_B(s);
        }
        KILN_COMMIT();
    }
    KILN_LANDED();
    __syncthreads();
    // a thread's fragments of k-step k of stage s into register set f (two sets where FRAG: the
    // next k-step's are read while the current one's FMAs run, across k-tiles too)
    float a[FRAG + 1][TM], b[FRAG + 1][TN];
#define KILN_FRAGMENT(f, s, k) do { \
        _Pragma("unroll") for (int p = 0; p < TM / 4; ++p) \
            *(float4*)&a[f][p * 4] = *(const float4*)&As[s][k][wm + p * 4 * LM]; \
        _Pragma("unroll") for (int p = 0; p < TN / 4; ++p) \
            *(float4*)&b[f][p * 4] = *(const float4*)&Bs[s][k][wn + p * 4 * LN]; \
    } while (0)
    // the end of k-tile kt's reads of shared memory: k-tile kt + STAGES - 1 stashed into the
    // stage kt - 1 left (every thread passed its reads at the last barrier), kt + 1 landed
#define KILN_TILE_END() do { \
        if (ahead) { KILN_STASH_A(last); KILN_STASH_B(last); } \
        KILN_LANDED(); \
        __syncthreads(); \
    } while (0)
    if constexpr (FRAG) KILN_FRAGMENT(0, 0, 0);
    for (int kt = 0; kt < KT; ++kt) {
        const int cur = kt % STAGES, last = (kt + STAGES - 1) % STAGES;
        const bool ahead = kt + STAGES - 1 < KT;
        if (ahead) {
            KILN_FETCH_A(kt + STAGES - 1, last);
            KILN_FETCH_B(kt + STAGES - 1, last);
        }
        KILN_COMMIT();
#pragma unroll
        for (int k = 0; k < BK; ++k) {
            if constexpr (!FRAG) {
                KILN_FRAGMENT(0, cur, k);
            } else if (k + 1 < BK) {
                KILN_FRAGMENT((k + 1) % 2, cur, k + 1);
            } else {
                KILN_TILE_END();
                KILN_FRAGMENT(0, (kt + 1) % STAGES, 0);
            }
            const int f = FRAG ? k % 2 : 0;
#pragma unroll
            for (int i = 0; i < TM; ++i)
#pragma unroll
                for (int j = 0; j < TN; ++j) acc[i][j] = fmaf(a[f][i], b[f][j], acc[i][j]);
        }
        if constexpr (!FRAG) KILN_TILE_END();
    }
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < TN; j += 2) {
            const int64_t m = m0 + wm + (i / 4) * 4 * LM + (i % 4);
            const int64_t n = n0 + wn + (j / 4) * 4 * LN + (j % 4);
            if (m < M && n + 1 < N) KILN_STORE2(bz, m, n, acc[i][j], acc[i][j + 1]);
            else if (m < M && n < N) KILN_STORE(bz, m, n, acc[i][j]);
        }
}
"""

GROUP_M = 8


def knobs(bm: int, bn: int, bk: int, wm: int, wn: int, min_blocks: int, async_: int = 1, stages: int = 2,
          frag: int = 0, **more) -> dict:
    """A knob setting of the template (named in `KNOBS` order), with `more` (SPLIT)."""
    return dict(zip(KNOBS, (bm, bn, bk, wm, wn, min_blocks, async_, stages, frag)), **more)


def smem_bytes(bm: int, bn: int, bk: int, stages: int) -> int:
    """The shared memory of a block: STAGES k-tiles of both operands, rows padded by 4 floats."""
    return stages * bk * (bm + 4 + bn + 4) * 4


def lanes(wm: int, wn: int) -> tuple[int, int]:
    """The LM x LN grid of a warp's lanes over its WM x WN tile."""
    return (8, 4) if wm > wn else (4, 8)


def thread_tile(bm: int, bn: int, wm: int, wn: int) -> tuple[int, int] | None:
    """A thread's TM x TN sub-tile, or None where the knobs make no valid layout (8 warps of
    WM x WN tiling BM x BN, sub-tiles of whole 4 x 4 pieces)."""
    lm, ln = lanes(wm, wn)
    if bm % wm or bn % wn or (bm // wm) * (bn // wn) != NT // 32 or wm % (4 * lm) or wn % (4 * ln):
        return None
    return wm // lm, wn // ln


def _fit_tile(bm: int, bn: int, bk: int, wm: int, wn: int, min_blocks: int, max_split: int = split_k.MAX_SPLIT,
              pipeline: dict | None = None) -> split_k.Tile:
    """A tile for `suggest` (with `pipeline`'s STAGES and FRAG): 128 FMAs per SM clock, less the
    shared-memory reads a thread's TM x TN FMAs wait on (TM + TN per k)."""
    tm, tn = thread_tile(bm, bn, wm, wn)
    return split_k.Tile(dict(knobs(bm, bn, bk, wm, wn, min_blocks), **(pipeline or {})), bm, bn, bk,
                        128 * tm * tn / (tm * tn + tm + tn), max_split)


SMALL_TILES = [_fit_tile(*s) for s in [(64, 128, 8, 32, 32, 2), (128, 64, 8, 32, 32, 2), (64, 64, 16, 16, 32, 2)]]
"""64 x 128 first: on an H100 it beat 128 x 64 on every BERT linear where the model ties them
(1024 x 768 x 768 0.811 of cuBLAS against 0.754, 128 x 3072 x 768 2.03 against 1.69)."""
FIT_TILES = [_fit_tile(128, 128, 8, 32, 64, 1), SMALL_TILES[1], SMALL_TILES[0], SMALL_TILES[2]]
"""Through the load hooks (convolutions) the 128 x 128 tile spills at two blocks an SM."""
ASYNC_PIPELINE = {"STAGES": 2, "FRAG": 1}
"""The plain 128 x 128 tile's pipeline where an operand is copied by cp.async (x @ W): on an
H100, 4096^3 0.825 -> 0.887 of cuBLAS."""
STAGED_PIPELINE = {"STAGES": 3, "FRAG": 0}
"""... where both operands go through registers (x @ W.T): 0.760 -> 0.828 (with FRAG, below 0.77)."""
ASYNC_FIT_TILES, STAGED_FIT_TILES = ([_fit_tile(128, 128, 8, 32, 64, 2, max_split=1, pipeline=pipeline)] + SMALL_TILES
                                     for pipeline in (ASYNC_PIPELINE, STAGED_PIPELINE))
"""Plain operands' 128 x 128 tile runs two blocks an SM (128 registers, no spills): on an H100,
4096^3 float32 0.815 -> 0.833 of cuBLAS, x @ W.T 0.542 -> 0.761. It is not split over K: on
grids of fewer blocks than SMs, 64 x 128 tiles split over K ran faster (1024 x 768 x 768 0.823
of cuBLAS against 0.719 for 128 x 128 split 8 ways, 128 x 768 x 2304 1.32 against 1.19)."""
LARGE_ASYNC_TILE = _fit_tile(128, 256, 8, 64, 64, 1, max_split=1, pipeline=ASYNC_PIPELINE)
"""Where an operand comes by cp.async, a 128 x 256 tile of 64 x 64 warp tiles (16 x 8 a thread,
one block an SM, 232 registers) ranks first: on an H100, 4096^3 x @ W 0.887 -> 0.928 of cuBLAS
(over 128 x 256 and 256 x 128 tiles, both warp shapes, 2 or 3 stages, with and without FRAG;
x @ W.T stays on 128 x 128, where every larger tile ran below 0.77)."""
ASYNC_FIT_TILES.insert(0, LARGE_ASYNC_TILE)
SUM_BYTES = 32
"""The split-K partials' bytes per SM clock in this template's cost model (`split_k.cost`): half
what the tensor-core templates assume. On an H100, 128 x 768 x 3072 split 8 ways over 64 x 128
tiles ran at 0.75 of cuBLAS against 0.85 for 4 ways, which the default ranked the other way.
Convolutions (the load hooks) are ranked with it too, measured only end to end (float32
ResNet-18 and ResNet-50 at batch 1, `benchmarks/HISTORY.md`)."""
SPLIT_PROBE = knobs(64, 64, 16, 16, 32, 2, SPLIT=2)


def space(level: int) -> list[dict]:
    """Level 0: 128 x 256 x 8 tiles of 64 x 64 warp tiles, one block an SM, cp.async where an
    operand allows, fragments double buffered: what `suggest` gives large GEMMs whose operand
    comes by cp.async (elsewhere it ranks 128 x 128 tiles of two blocks an SM, with
    `STAGED_PIPELINE` where both operands go through registers, smaller tiles and split-K);
    level 1 adds that 128 x 128 tile, the other warp shape, a deeper k-step, one block an SM
    (what `suggest` gives the load hooks), register-staged copies only, smaller tiles, split-K,
    the 128 x 128 tile over 2 to 4 stages with and without FRAG, and another 128 x 256 warp
    shape; level 2 more combinations of them."""
    settings = []        # after the level-0 tile, `LARGE_ASYNC_TILE`
    if level >= 1:
        settings += [(128, 128, 8, 32, 64, 2, 1, 2, 1), (128, 128, 8, 64, 32, 1, 1), (128, 128, 16, 32, 64, 1, 1),
                     (128, 128, 8, 32, 64, 1, 1), (128, 128, 8, 32, 64, 1, 0), (128, 64, 8, 32, 32, 2, 1), (64, 128, 8, 32, 32, 2, 1),
                     (128, 128, 8, 32, 64, 2, 1), (128, 128, 8, 32, 64, 2, 1, 3), (128, 128, 8, 32, 64, 2, 1, 3, 1),
                     (128, 128, 8, 32, 64, 2, 1, 4, 1), (128, 128, 8, 32, 64, 1, 1, 3, 1),
                     (128, 256, 8, 32, 128, 1, 1, 3, 1)]
    if level >= 2:
        settings += [(128, 128, 16, 64, 32, 1, 1), (128, 128, 16, 32, 64, 2, 1), (128, 128, 8, 64, 32, 2, 1),
                     (128, 128, 16, 32, 64, 1, 0), (128, 64, 16, 32, 32, 2, 1), (64, 128, 16, 32, 32, 2, 1),
                     (64, 64, 8, 16, 32, 2, 1), (64, 64, 16, 32, 16, 2, 1), (128, 64, 8, 64, 16, 2, 1),
                     (128, 128, 8, 64, 32, 2, 1, 3, 1),
                     (128, 128, 16, 32, 64, 1, 1, 2, 1), (128, 64, 8, 32, 32, 2, 1, 3, 1),
                     (64, 128, 8, 32, 32, 2, 1, 3, 1), (64, 64, 16, 16, 32, 2, 1, 3, 1),
                     (256, 128, 8, 64, 64, 1, 1, 2, 1), (256, 128, 8, 128, 32, 1, 1, 2, 1),
                     (128, 256, 8, 64, 64, 1, 1, 3, 1)]
    probe = [dict(SPLIT_PROBE)] if level >= 1 else []
    return [dict(LARGE_ASYNC_TILE.knobs)] + [knobs(*s) for s in settings] + probe


def _gemm(task) -> Contraction | HookedGemm:
    """The GEMM `task` computes: a float32 contraction of plain loads, else through load hooks."""
    c = match_contraction(task)
    return c if c is not None and c.a.dtype == dtypes.float32 else match_hooked_gemm(task)


def suggest(task, sm_count: int) -> list[dict]:
    """Tiles and split-K ranked by `split_k`'s cost model for this shape (symbolic sizes by
    their bucket)."""
    g = _gemm(task)
    plain = isinstance(g, Contraction)
    tiles = FIT_TILES
    if plain:
        d = _plain_defines(g, 1)
        tiles = ASYNC_FIT_TILES if d["A_ASYNC"] or d["B_ASYNC"] else STAGED_FIT_TILES
    return split_k.rank(tiles, *(split_k.bucket(x) for x in (g.M, g.N, g.K, g.batch_count if plain else 1)),
                        sm_count, 4, SUM_BYTES)


def _operand_defines(prefix: str, op: Operand, extent, K, use_async: int, text) -> dict:
    """An operand's layout; 4-wide copies (W) where every copy can be an aligned float4 along
    its contiguous dimension (that dimension's stride 1 and extent a multiple of 4, every other
    stride a multiple of 4, buffers 16-byte aligned), by cp.async where ASYNC and that
    dimension is m or n."""
    kc = int(op.k_contiguous and not op.x_contiguous)
    vec = (K if kc else extent) % 4 == 0 and op.strides_multiple_of(4) and (op.k_stride if kc else op.x_stride) == 1
    return {f"{prefix}_XS": f"(int64_t){text(op.x_stride)}", f"{prefix}_KS": f"(int64_t){text(op.k_stride)}",
            f"{prefix}_K_CONTIGUOUS": kc, f"{prefix}_W": 4 if vec else 1,
            f"{prefix}_ASYNC": int(bool(use_async and vec and not kc))}


def _plain_defines(c: Contraction, ASYNC: int) -> dict:
    """Operands read straight from memory (float32 matmul, batched matmul, linear)."""
    return {"HOOKS": 0, "A_PARAM": c.a.param, "B_PARAM": c.b.param,
            "A_BATCH": c.batch_offset(c.a, "bz"), "B_BATCH": c.batch_offset(c.b, "bz"),
            **_operand_defines("A", c.a, c.M, c.K, ASYNC, c.text),
            **_operand_defines("B", c.b, c.N, c.K, ASYNC, c.text)}


def _hook_defines(g: HookedGemm) -> dict:
    """Operands read through the core's load hooks (convolutions: im2col on the fly). Threads
    walk A along m (neighbouring output pixels) and B along k (a filter's contiguous taps)."""
    return {"HOOKS": 1, "A_ASYNC": 0, "B_ASYNC": 0,
            "LOAD_A(x, k)": f"kiln_load_a({g.args}, (x), (k))", "LOAD_B(x, k)": f"kiln_load_b({g.args}, (k), (x))"}


def applies(task) -> bool:
    c = match_contraction(task)
    if c is not None:
        return c.a.dtype == dtypes.float32 and c.b.dtype == dtypes.float32
    g = match_hooked_gemm(task)
    return g is not None and g.acc_dtype == dtypes.float32


def render(task, BM, BN, BK, WM=None, WN=None, MIN_BLOCKS=1, ASYNC=1, STAGES=2, FRAG=0, SPLIT=1) -> CudaProgram:
    """The program for `task` with these knobs (warp tiles, when not given, a 4 x 2 grid)."""
    WM, WN = WM or BM // 4, WN or BN // 2
    tile = thread_tile(BM, BN, WM, WN)
    if tile is None or BK % 8 or (BM * BK) % NT or (BN * BK) % NT:
        raise ValueError(f"invalid matmul_simt knobs {BM}x{BN}x{BK}, warp tile {WM}x{WN}")
    if STAGES < 2 or FRAG not in (0, 1):
        raise ValueError(f"invalid matmul_simt knobs STAGES={STAGES} (2 or more), FRAG={FRAG} (0 or 1)")
    if smem_bytes(BM, BN, BK, STAGES) > MAX_SMEM:
        raise ValueError(f"matmul_simt knobs BM={BM}, BN={BN}, BK={BK}, STAGES={STAGES} need "
                         f"{smem_bytes(BM, BN, BK, STAGES)} bytes of shared memory, over the {MAX_SMEM} of a "
                         f"kernel's static shared memory")
    g = _gemm(task)
    if isinstance(g, Contraction):
        batch, hooks, defines = g.batch_count, g.epilogue, _plain_defines(g, ASYNC)
    else:
        batch, hooks, defines = 1, g.hooks, _hook_defines(g)
    names, temporaries = tuple(g.args.split(", ")), []
    sk = split_k.plan(SPLIT, g.M, g.N, g.K, BK, batch, g.params, names, temporaries, text=g.text)
    lm, ln = lanes(WM, WN)
    defines.update({"BM": BM, "BN": BN, "BK": BK, "WM": WM, "WN": WN, "LM": lm, "LN": ln, "TM": tile[0],
                    "TN": tile[1], "MIN_BLOCKS": MIN_BLOCKS, "STAGES": STAGES, "FRAG": FRAG, "GROUP_M": GROUP_M,
                    "M": g.text(g.M), "N": g.text(g.N), "K": g.text(g.K), "ARGS": g.args, **sk.defines})
    tiles = int(-(-g.M // BM) * -(-g.N // BN))
    launch = Launch("kiln_matmul_simt", names + sk.args, (NT, 1, 1), grid=(tiles, SPLIT, int(batch)))
    wrappers = (ptx.CP_ASYNC,) if defines["A_ASYNC"] or defines["B_ASYNC"] else ()
    return CudaProgram(template_source([COPIES, KERNEL, sk.source], defines, hooks, wrappers),
                       [launch, *sk.launches], temporaries, alignment=16, sizes=g.sizes.values)


TEMPLATE = Template("matmul_simt", ("matmul", "linear", "conv1d", "conv2d", "conv_transpose2d"), "cuda",
                    render, priority=10, applies=applies, space=space, suggest=suggest, reads_views=True,
                    symbolic=True)
