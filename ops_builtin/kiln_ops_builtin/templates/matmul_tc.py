"""Matmul, batched matmul and linear in float16/bfloat16 on tensor cores (sm_80+).

A block computes a BM x BN tile of the output with warps of WM x WN tiles; K advances BK at a
time through a STAGES-deep ring of shared-memory tiles filled by `cp.async` (16-byte copies,
zero-filled past the matrix edges). Fragments load with `ldmatrix` (`.trans` for a row-major
[K, N] operand) from XOR-swizzled tiles, so that neither the copies nor `ldmatrix` conflict on
banks; `mma.sync.m16n8k16` accumulates in float32. Each output element goes through the core's
epilogue hook (`kiln.codegen.hooks`), so bias, activation and the final cast are fused there;
with split-K (`kiln_ops_builtin.templates.split_k`) through the sum kernel's.

Symbolic sizes (`Template.symbolic`): M, N, K, strides and batch dims are kernel arguments
(`Contraction.sizes`); `suggest` buckets them by powers of two (`split_k.bucket`), so the sizes
of a bucket share one source.
"""
from __future__ import annotations

import itertools

from kiln.template import Contraction, CudaProgram, Launch, Template, dtypes, match_contraction, ptx, template_source
from kiln_ops_builtin.templates import split_k

MAX_SMEM = 227 * 1024
DEFAULT = {"BM": 128, "BN": 128, "BK": 32, "WM": 64, "WN": 64, "STAGES": 4}

MMA_STEP = r"""
// One BK-deep step of a warp's WM x WN tile: ldmatrix fragments of the swizzled k-major tiles
// `as` and `bs` (`bs` k-major when B_K_CONTIGUOUS, else [BK, BN] row-major) into mma.sync.
static __device__ __forceinline__ void kiln_mma_step(float (*acc)[WN / 8][4], const uint16_t* as, const uint16_t* bs,
                                                     int wm, int wn, int lane) {
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk) {
            unsigned af[WM / 16][4], bf[WN / 8][2];
#pragma unroll
            for (int i = 0; i < WM / 16; ++i) {
                const int r = wm * WM + i * 16 + (lane & 15), c = kk * 2 + (lane >> 4);
                kiln_ldmatrix_x4(af[i], as + r * BK + kiln_swz(r, c, BK / 8) * 8);
            }
#pragma unroll
            for (int j = 0; j < WN / 16; ++j) {
                unsigned t[4];
#if B_K_CONTIGUOUS
                const int r = wn * WN + j * 16 + (lane >> 4) * 8 + (lane & 7), c = kk * 2 + ((lane >> 3) & 1);
                kiln_ldmatrix_x4(t, bs + r * BK + kiln_swz(r, c, BK / 8) * 8);
#else
                const int r = kk * 16 + (lane & 15), c = (wn * WN + j * 16) / 8 + (lane >> 4);
                kiln_ldmatrix_x4_trans(t, bs + r * BN + kiln_swz(r, c, BN / 8) * 8);
#endif
                bf[2 * j][0] = t[0]; bf[2 * j][1] = t[1]; bf[2 * j + 1][0] = t[2]; bf[2 * j + 1][1] = t[3];
            }
#pragma unroll
            for (int i = 0; i < WM / 16; ++i)
#pragma unroll
                for (int j = 0; j < WN / 8; ++j)
                    MMA(acc[i][j], af[i], bf[j]);
        }
}
"""
"""`kiln_mma_step(acc, as, bs, wm, wn, lane)`, shared with conv_tc; reads the knobs BK, BN, WM,
WN, B_K_CONTIGUOUS and MMA (the `kiln.codegen.ptx.mma_m16n8k16` product of the operand type)."""

KERNEL = r"""
extern "C" __global__ void __launch_bounds__(NT) kiln_matmul_tc(PARAMS) {
    extern __shared__ __align__(128) unsigned char kiln_smem[];
    uint16_t* As = (uint16_t*)kiln_smem;
    uint16_t* Bs = As + STAGES * BM * BK;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp / (BN / WN), wn = warp % (BN / WN);
    // grouped rasterization: GROUP row-tiles share B's column tiles in L2
    const int tiles_m = (M + BM - 1) / BM, tiles_n = (N + BN - 1) / BN;
    const int pid = blockIdx.x, group = pid / (GROUP * tiles_n);
    const int first_m = group * GROUP, rows = min(tiles_m - first_m, GROUP);
    const int tm = first_m + (pid % (GROUP * tiles_n)) % rows, tn = (pid % (GROUP * tiles_n)) / rows;
    const int64_t m0 = (int64_t)tm * BM, n0 = (int64_t)tn * BN, bz = blockIdx.z;
    const uint16_t* A = (const uint16_t*)A_PARAM + (A_BATCH);
    const uint16_t* B = (const uint16_t*)B_PARAM + (B_BATCH);
    float acc[WM / 16][WN / 8][4];
#pragma unroll
    for (int i = 0; i < WM / 16; ++i)
#pragma unroll
        for (int j = 0; j < WN / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;
    const int KT0 = blockIdx.y * KT_SPLIT, KT = min((int)((K + BK - 1) / BK) - KT0, KT_SPLIT);
    auto load = [&](int stage, int kt) {
        uint16_t* as = As + stage * BM * BK;
        uint16_t* bs = Bs + stage * BN * BK;
#pragma unroll
        for (int i = 0; i < BM * (BK / 8) / NT; ++i) {
            const int idx = tid + i * NT, r = idx / (BK / 8), c = idx % (BK / 8);
            const int64_t gm = m0 + r, gk = (int64_t)(KT0 + kt) * BK + c * 8;
            const bool ok = gm < M && gk < K;
            kiln_cp_async16(as + r * BK + kiln_swz(r, c, BK / 8) * 8, A + (ok ? gm * A_XS + gk : 0), ok ? 16 : 0);
        }
#if B_K_CONTIGUOUS
#pragma unroll
        for (int i = 0; i < BN * (BK / 8) / NT; ++i) {
            const int idx = tid + i * NT, r = idx / (BK / 8), c = idx % (BK / 8);
            const int64_t gn = n0 + r, gk = (int64_t)(KT0 + kt) * BK + c * 8;
            const bool ok = gn < N && gk < K;
            kiln_cp_async16(bs + r * BK + kiln_swz(r, c, BK / 8) * 8, B + (ok ? gn * B_XS + gk : 0), ok ? 16 : 0);
        }
#else
#pragma unroll
        for (int i = 0; i < BK * (BN / 8) / NT; ++i) {
            const int idx = tid + i * NT, r = idx / (BN / 8), c = idx % (BN / 8);
            const int64_t gk = (int64_t)(KT0 + kt) * BK + r, gn = n0 + c * 8;
            const bool ok = gk < K && gn < N;
            kiln_cp_async16(bs + r * BN + kiln_swz(r, c, BN / 8) * 8, B + (ok ? gk * B_KS + gn : 0), ok ? 16 : 0);
        }
#endif
    };
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < KT) load(s, s);
        kiln_cp_async_commit();
    }
    for (int kt = 0; kt < KT; ++kt) {
        kiln_cp_async_wait<STAGES - 2>();
        __syncthreads();
        if (kt + STAGES - 1 < KT) load((kt + STAGES - 1) % STAGES, kt + STAGES - 1);
        kiln_cp_async_commit();
        const uint16_t* as = As + (kt % STAGES) * BM * BK;
        const uint16_t* bs = Bs + (kt % STAGES) * BN * BK;
        kiln_mma_step(acc, as, bs, wm, wn, lane);
    }
    kiln_cp_async_wait<0>();
#pragma unroll
    for (int i = 0; i < WM / 16; ++i)
#pragma unroll
        for (int j = 0; j < WN / 8; ++j)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int64_t m = m0 + wm * WM + i * 16 + (lane >> 2) + h * 8;
                const int64_t n = n0 + wn * WN + j * 8 + (lane & 3) * 2;
                if (m < M && n + 1 < N) KILN_STORE2(bz, m, n, acc[i][j][2 * h], acc[i][j][2 * h + 1]);
                else if (m < M && n < N) KILN_STORE(bz, m, n, acc[i][j][2 * h]);
            }
}
"""


def smem_bytes(k: dict) -> int:
    return k["STAGES"] * (k["BM"] + k["BN"]) * k["BK"] * 2


def valid(k: dict) -> bool:
    """Whether a knob setting makes a launchable kernel (whole copies per thread, smem fits)."""
    warps = (k["BM"] // k["WM"]) * (k["BN"] // k["WN"])
    nt = warps * 32
    return (k["BM"] % k["WM"] == 0 and k["BN"] % k["WN"] == 0 and k["WM"] % 16 == 0 and k["WN"] % 16 == 0
            and 2 <= warps <= 8 and (k["BM"] * k["BK"] // 8) % nt == 0 and (k["BN"] * k["BK"] // 8) % nt == 0
            and smem_bytes(k) <= MAX_SMEM and k["STAGES"] >= 2)


SPLIT_PROBE = {"BM": 64, "BN": 64, "BK": 32, "WM": 32, "WN": 32, "STAGES": 4, "SPLIT": 2}
FIT_TILES = [split_k.Tile(dict(zip(DEFAULT, s)), s[0], s[1], s[2], 1024)
             for s in [(128, 128, 32, 64, 64, 4), (128, 64, 32, 64, 32, 4), (64, 128, 32, 32, 64, 4),
                       (64, 64, 32, 32, 32, 4)]]
"""`suggest`'s tiles, at mma.sync's 1024 float16 MACs per SM clock (half of wgmma's)."""


def space(level: int) -> list[dict]:
    """Level 0: the default; 1: a few tile shapes and split-K; 2: tiles x warp tiles x depths."""
    if level == 0:
        return [dict(DEFAULT)]
    if level == 1:
        shapes = [(128, 128, 32, 64, 64, 4), (128, 256, 32, 64, 64, 3), (256, 128, 32, 64, 64, 3),
                  (64, 128, 32, 32, 64, 4), (128, 128, 64, 64, 64, 3)]
        return [dict(zip(DEFAULT, s)) for s in shapes] + [dict(SPLIT_PROBE)]
    out = []
    for bm, bn, bk, (wm, wn), st in itertools.product((64, 128, 256), (64, 128, 256), (32, 64),
                                                       ((64, 64), (32, 64), (64, 32)), (3, 4, 5)):
        k = {"BM": bm, "BN": bn, "BK": bk, "WM": wm, "WN": wn, "STAGES": st}
        if valid(k) and bm * bn >= 128 * 64:
            out.append(k)
    return out


def applies(task) -> bool:
    c = match_contraction(task)
    return (c is not None and c.a.dtype in (dtypes.float16, dtypes.bfloat16) and c.a.dtype == c.b.dtype
            and c.a.k_contiguous and c.K % 8 == 0 and (c.b.k_contiguous or (c.b.x_contiguous and c.N % 8 == 0))
            and c.a.strides_multiple_of(8) and c.b.strides_multiple_of(8))


def suggest(task, sm_count: int) -> list[dict]:
    """Tiles and split-K ranked by `split_k`'s cost model for this shape (symbolic sizes by
    their bucket)."""
    c = match_contraction(task)
    return split_k.rank(FIT_TILES, *(split_k.bucket(x) for x in (c.M, c.N, c.K, c.batch_count)), sm_count, 2)


def render(task, BM, BN, BK, WM, WN, STAGES, GROUP=8, SPLIT=1) -> CudaProgram:
    c: Contraction = match_contraction(task)
    k = {"BM": BM, "BN": BN, "BK": BK, "WM": WM, "WN": WN, "STAGES": STAGES}
    if not valid(k):
        raise ValueError(f"invalid matmul_tc knobs {k}")
    args, temporaries = tuple(c.args.split(", ")), []
    sk = split_k.plan(SPLIT, c.M, c.N, c.K, BK, c.batch_count, c.params, args, temporaries, text=c.text)
    nt = (BM // WM) * (BN // WN) * 32
    defines = {
        "NT": nt, "BM": BM, "BN": BN, "BK": BK, "WM": WM, "WN": WN, "STAGES": STAGES, "GROUP": GROUP,
        "M": c.text(c.M), "N": c.text(c.N), "K": c.text(c.K), "A_XS": f"(int64_t){c.text(c.a.x_stride)}",
        "B_XS": f"(int64_t){c.text(c.b.x_stride)}", "B_KS": f"(int64_t){c.text(c.b.k_stride)}",
        "B_K_CONTIGUOUS": int(c.b.k_contiguous),
        "A_PARAM": c.a.param, "B_PARAM": c.b.param, "A_BATCH": c.batch_offset(c.a, "bz"),
        "B_BATCH": c.batch_offset(c.b, "bz"), "ARGS": c.args, **sk.defines,
    }
    source = template_source([MMA_STEP, KERNEL, sk.source], {**defines, "MMA": ptx.mma_m16n8k16(c.a.dtype)},
                             c.epilogue, (ptx.CP_ASYNC, ptx.LDMATRIX, ptx.MMA))
    tiles = int(-(-c.M // BM) * -(-c.N // BN))
    launch = Launch("kiln_matmul_tc", args + sk.args, (nt, 1, 1), grid=(tiles, SPLIT, int(c.batch_count)),
                    smem=smem_bytes(k))
    return CudaProgram(source, [launch, *sk.launches], temporaries, alignment=16, sizes=c.sizes.values)


TEMPLATE = Template("matmul_tc", ("matmul", "linear"), "cuda", render, priority=10, applies=applies, space=space,
                    suggest=suggest, reads_views=True, symbolic=True)
