"""Matmul, batched matmul and linear in float16/bfloat16 with Hopper's wgmma (sm_90a).

Each of WG warpgroups computes MI slabs of 64 rows x BN columns with
`wgmma.mma_async.m64n{BN}k16`, both operands read by the tensor cores straight from shared
memory through descriptors. Tiles are BK = 64 elements (128 bytes) deep in the 128-byte-swizzled
K-major layout wgmma expects, filled STAGES deep by `cp.async` (zero-filled past the edges).
An operand that is not K-contiguous in 16-byte aligned rows (a row-major [K, N] weight, K not
a multiple of eight, a strided view) is first staged K-major into a temporary
(`kiln_ops_builtin.templates.stage`). Outputs go through the core's epilogue hooks, or with split-K
(`kiln_ops_builtin.templates.split_k`) through the sum kernel's.

Symbolic sizes (`Template.symbolic`): M, N, K, strides and batch dims are kernel arguments
(`Contraction.sizes`), staged operands' temporaries sized by their values; `suggest` buckets them
by powers of two (`split_k.bucket`), so the sizes of a bucket share one source.
"""
from __future__ import annotations

from kiln.template import Contraction, CudaProgram, Launch, Template, dtypes, match_contraction, ptx, template_source
from kiln_ops_builtin.templates import split_k, stage

BK = 64
MAX_SMEM = 227 * 1024
DEFAULT = {"BN": 128, "WG": 2, "MI": 1, "STAGES": 4}

KERNEL = r"""
extern "C" __global__ void __launch_bounds__(NT, 1) kiln_matmul_wgmma(PARAMS, const uint16_t* __restrict__ a_source,
                                                                    const uint16_t* __restrict__ b_source) {
    extern __shared__ unsigned char kiln_smem_raw[];
    uint16_t* As = (uint16_t*)(((uint64_t)kiln_smem_raw + 1023) & ~(uint64_t)1023);
    uint16_t* Bs = As + STAGES * BM * BK;
    const int tid = threadIdx.x, wg = tid / 128, t = tid % 128, w = t / 32, lane = t % 32;
    const int tiles_m = (M + BM - 1) / BM, tiles_n = (N + BN - 1) / BN;
    const int pid = blockIdx.x, group = pid / (8 * tiles_n);
    const int first_m = group * 8, rows = min(tiles_m - first_m, 8);
    const int tm = first_m + (pid % (8 * tiles_n)) % rows, tn = (pid % (8 * tiles_n)) / rows;
    const int64_t m0 = (int64_t)tm * BM, n0 = (int64_t)tn * BN, bz = blockIdx.z;
    const uint16_t* A = a_source + (A_BATCH);
    const uint16_t* B = b_source + (B_BATCH);
    float acc[MI][BN / 2];
#pragma unroll
    for (int i = 0; i < MI; ++i)
#pragma unroll
        for (int j = 0; j < BN / 2; ++j) acc[i][j] = 0.f;
    const int KT0 = blockIdx.y * KT_SPLIT, KT = min((int)((K + BK - 1) / BK) - KT0, KT_SPLIT);
    auto load = [&](int stage, int kt) {
        uint16_t* as = As + stage * BM * BK;
        uint16_t* bs = Bs + stage * BN * BK;
#pragma unroll
        for (int i = 0; i < BM * 8 / NT; ++i) {
            const int idx = tid + i * NT, r = idx / 8, c = idx % 8;
            const int64_t gm = m0 + r, gk = (int64_t)(KT0 + kt) * BK + c * 8;
            const bool ok = gm < M && gk < K;
            kiln_cp_async16(as + r * BK + (c ^ (r & 7)) * 8, A + (ok ? gm * A_XS + gk : 0), ok ? 16 : 0);
        }
#pragma unroll
        for (int i = 0; i < BN * 8 / NT; ++i) {
            const int idx = tid + i * NT, r = idx / 8, c = idx % 8;
            const int64_t gn = n0 + r, gk = (int64_t)(KT0 + kt) * BK + c * 8;
            const bool ok = gn < N && gk < K;
            kiln_cp_async16(bs + r * BK + (c ^ (r & 7)) * 8, B + (ok ? gn * B_XS + gk : 0), ok ? 16 : 0);
        }
    };
    // Tiles are fetched AHEAD = STAGES - 2 steps early, and one wgmma group stays in flight
    // while the next is issued: the stage being refilled was last read two groups ago.
#pragma unroll
    for (int s = 0; s < AHEAD; ++s) {
        if (s < KT) load(s, s);
        kiln_cp_async_commit();
    }
    for (int kt = 0; kt < KT; ++kt) {
        kiln_cp_async_wait<AHEAD - 1>();
        kiln_fence_proxy_async();
        __syncthreads();
        if (kt + AHEAD < KT) load((kt + AHEAD) % STAGES, kt + AHEAD);
        kiln_cp_async_commit();
        const uint16_t* as = As + (kt % STAGES) * BM * BK;
        const uint16_t* bs = Bs + (kt % STAGES) * BN * BK;
        kiln_wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk) {
            const uint64_t db = kiln_desc(bs) + 2 * kk;
#pragma unroll
            for (int i = 0; i < MI; ++i) {
                const uint64_t da = kiln_desc(as + (wg * MI + i) * 64 * BK) + 2 * kk;
                WGMMA(acc[i], da, db);
            }
        }
        kiln_wgmma_commit();
        kiln_wgmma_wait<1>();
    }
    kiln_wgmma_wait<0>();
    kiln_cp_async_wait<0>();
#pragma unroll
    for (int i = 0; i < MI; ++i)
#pragma unroll
        for (int j = 0; j < BN / 8; ++j)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int64_t m = m0 + (wg * MI + i) * 64 + w * 16 + lane / 4 + h * 8;
                const int64_t n = n0 + j * 8 + (lane % 4) * 2;
                if (m < M && n + 1 < N)
                    kiln_store2(KERNEL_ARGS, blockIdx.y, bz, m, n, acc[i][j * 4 + h * 2], acc[i][j * 4 + h * 2 + 1]);
                else if (m < M && n < N) kiln_store(KERNEL_ARGS, blockIdx.y, bz, m, n, acc[i][j * 4 + h * 2]);
            }
}
"""


def smem_bytes(k: dict) -> int:
    return k["STAGES"] * (64 * k["WG"] * k["MI"] + k["BN"]) * BK * 2 + 1024


SPLIT_PROBE = {"BN": 64, "WG": 1, "MI": 1, "STAGES": 4, "SPLIT": 2}
FIT_TILES = [split_k.Tile(dict(zip(DEFAULT, s)), 64 * s[1] * s[2], s[0], BK, 2048)
             for s in [(128, 2, 1, 4), (64, 2, 1, 4), (128, 1, 1, 4), (64, 1, 1, 4)]]
"""`suggest`'s tiles (128 or 64 rows by 128 or 64 columns), at wgmma's 2048 float16 MACs per SM clock."""


def space(level: int) -> list[dict]:
    """Level 0: 128x128 on two warpgroups, 4 stages; 1 and 2: wider tiles, other depths, split-K."""
    if level == 0:
        return [dict(DEFAULT)]
    shapes = [(128, 2, 1, 4), (256, 2, 1, 4), (128, 1, 2, 4), (256, 2, 1, 5)]
    if level == 2:
        shapes += [(128, 2, 1, 5), (256, 2, 1, 3), (128, 2, 2, 3), (128, 1, 1, 6), (128, 2, 2, 4), (128, 2, 1, 6)]
    out = [dict(zip(DEFAULT, s)) for s in shapes] + [dict(SPLIT_PROBE)]
    return [k for k in out if smem_bytes(k) <= MAX_SMEM]


def suggest(task, sm_count: int) -> list[dict]:
    """Tiles and split-K ranked by `split_k`'s cost model for this shape (symbolic sizes by
    their bucket)."""
    c = match_contraction(task)
    return split_k.rank(FIT_TILES, *(split_k.bucket(x) for x in (c.M, c.N, c.K, c.batch_count)), sm_count, 2)


def applies(task) -> bool:
    c = match_contraction(task)
    return (c is not None and c.a.dtype in (dtypes.float16, dtypes.bfloat16) and c.a.dtype == c.b.dtype
            and c.K > 0)


def render(task, BN, WG, MI, STAGES, SPLIT=1) -> CudaProgram:
    c: Contraction = match_contraction(task)
    bm, nt = 64 * WG * MI, 128 * WG
    args, temporaries = tuple(c.args.split(", ")), []
    a = stage.stage(c, c.a, c.M, "kiln_stage_a", temporaries)
    b = stage.stage(c, c.b, c.N, "kiln_stage_b", temporaries)
    K = stage.padded_k(c) if a.launch or b.launch else c.K
    sk = split_k.plan(SPLIT, c.M, c.N, K, BK, c.batch_count, c.params, args, temporaries, text=c.text)
    defines = {
        "NT": nt, "BM": bm, "BN": BN, "BK": BK, "MI": MI, "STAGES": STAGES, "AHEAD": STAGES - 2,
        "M": c.text(c.M), "N": c.text(c.N), "K": c.text(K), "ARGS": c.args,
        "A_XS": a.x_stride, "A_BATCH": a.batch, "B_XS": b.x_stride, "B_BATCH": b.batch, **sk.defines,
    }
    kernels = [ptx.wgmma_m64k16(BN, c.a.dtype), a.source, b.source, sk.stores, KERNEL, sk.source]
    source = template_source(kernels, defines, c.epilogue, (ptx.CP_ASYNC, ptx.LDMATRIX, ptx.WGMMA))
    tiles = int(-(-c.M // bm) * -(-c.N // BN))
    k = {"BN": BN, "WG": WG, "MI": MI, "STAGES": STAGES}
    launches = [s.launch for s in (a, b) if s.launch]
    launches.append(Launch("kiln_matmul_wgmma", args + sk.args + (a.arg, b.arg), (nt, 1, 1),
                           grid=(tiles, SPLIT, int(c.batch_count)), smem=smem_bytes(k)))
    launches += sk.launches
    return CudaProgram(source, launches, temporaries, arch_suffix="a", min_arch=90, alignment=16,
                       sizes=c.sizes.values)


TEMPLATE = Template("matmul_wgmma", ("matmul", "linear"), "cuda", render, priority=20, applies=applies,
                    space=space, min_arch=90, suggest=suggest, reads_views=True, symbolic=True)
