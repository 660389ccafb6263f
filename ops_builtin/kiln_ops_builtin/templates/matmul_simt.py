"""Matmul, batched matmul and linear in float32 on the CUDA cores (no TF32).

A block of 256 threads computes a BM x BN output tile, each thread a TM x TN sub-tile made of
four 4-row x 4-column pieces spread half a tile apart (conflict-free 16-byte shared-memory
reads). K advances BK at a time through two shared-memory buffers: the next tile is read from
global memory into registers while the current one is multiplied. Both operands are stored
k-major in shared memory; an operand that is k-contiguous in memory (A, or B of `linear`) is
transposed on the way in. Outputs go through the core's epilogue hook.
"""
from __future__ import annotations

from kiln import dtypes
from kiln.codegen.cuda import CUDA_PRELUDE
from kiln.codegen.hooks import Contraction, Operand, match_contraction
from kiln.schedule import Template
from kiln.schedule.cuda_program import CudaProgram, Launch

NT = 256
DEFAULT = {"BM": 128, "BN": 128, "BK": 8, "MIN_BLOCKS": 1}

KERNEL = r"""
extern "C" __global__ void __launch_bounds__(256, MIN_BLOCKS) kiln_matmul_simt(PARAMS) {
    __shared__ __align__(16) float As[2][BK][BM];
    __shared__ __align__(16) float Bs[2][BK][BN];
    const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
    // grouped rasterization: 8 row-tiles share B's column tiles in L2
    const int tiles_m = (M + BM - 1) / BM, tiles_n = (N + BN - 1) / BN;
    const int pid = blockIdx.x, group = pid / (8 * tiles_n);
    const int first_m = group * 8, rows = min(tiles_m - first_m, 8);
    const int64_t m0 = (int64_t)(first_m + (pid % (8 * tiles_n)) % rows) * BM;
    const int64_t n0 = (int64_t)((pid % (8 * tiles_n)) / rows) * BN;
    const int64_t bz = blockIdx.z;
    const float* A = A_PARAM + (A_BATCH);
    const float* B = B_PARAM + (B_BATCH);
    // operand X's tile is BK x BX; each thread copies LX elements of it per k-step
    float ra[LA], rb[LB];
    auto fetch = [&](int64_t k0) {
#pragma unroll
        for (int i = 0; i < LA; ++i) {
            const int idx = tid + i * 256;
#if A_K_CONTIGUOUS
            const int x = idx / BK, k = idx % BK;
#else
            const int k = idx / BM, x = idx % BM;
#endif
            const int64_t gx = m0 + x, gk = k0 + k;
            ra[i] = (gx < M && gk < K) ? A[gx * A_XS + gk * A_KS] : 0.f;
        }
#pragma unroll
        for (int i = 0; i < LB; ++i) {
            const int idx = tid + i * 256;
#if B_K_CONTIGUOUS
            const int x = idx / BK, k = idx % BK;
#else
            const int k = idx / BN, x = idx % BN;
#endif
            const int64_t gx = n0 + x, gk = k0 + k;
            rb[i] = (gx < N && gk < K) ? B[gx * B_XS + gk * B_KS] : 0.f;
        }
    };
    auto stash = [&](int buf) {
#pragma unroll
        for (int i = 0; i < LA; ++i) {
            const int idx = tid + i * 256;
#if A_K_CONTIGUOUS
            As[buf][idx % BK][idx / BK] = ra[i];
#else
            As[buf][idx / BM][idx % BM] = ra[i];
#endif
        }
#pragma unroll
        for (int i = 0; i < LB; ++i) {
            const int idx = tid + i * 256;
#if B_K_CONTIGUOUS
            Bs[buf][idx % BK][idx / BK] = rb[i];
#else
            Bs[buf][idx / BN][idx % BN] = rb[i];
#endif
        }
    };
    float acc[TM][TN];
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j) acc[i][j] = 0.f;
    fetch(0);
    stash(0);
    __syncthreads();
    const int KT = (K + BK - 1) / BK;
    for (int kt = 0; kt < KT; ++kt) {
        const int cur = kt & 1;
        if (kt + 1 < KT) fetch((int64_t)(kt + 1) * BK);
#pragma unroll
        for (int k = 0; k < BK; ++k) {
            float a[TM], b[TN];
#pragma unroll
            for (int p = 0; p < TM / 4; ++p)
                *(float4*)&a[p * 4] = *(const float4*)&As[cur][k][p * (BM / (TM / 4)) + ty * 4];
#pragma unroll
            for (int p = 0; p < TN / 4; ++p)
                *(float4*)&b[p * 4] = *(const float4*)&Bs[cur][k][p * (BN / (TN / 4)) + tx * 4];
#pragma unroll
            for (int i = 0; i < TM; ++i)
#pragma unroll
                for (int j = 0; j < TN; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
        }
        if (kt + 1 < KT) stash(cur ^ 1);
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < TN; j += 2) {
            const int64_t m = m0 + (i / 4) * (BM / (TM / 4)) + ty * 4 + (i % 4);
            const int64_t n = n0 + (j / 4) * (BN / (TN / 4)) + tx * 4 + (j % 4);
            if (m < M && n + 1 < N) kiln_epilogue2(ARGS, bz, m, n, acc[i][j], acc[i][j + 1]);
            else if (m < M && n < N) kiln_epilogue(ARGS, bz, m, n, acc[i][j]);
        }
}
"""


def space(level: int) -> list[dict]:
    """Level 0: 128x128x8; levels 1 and 2 add other tile sizes and a deeper k-step."""
    shapes = [(128, 128, 8, 1)]
    if level >= 1:
        shapes += [(128, 128, 8, 2), (128, 64, 8, 2), (64, 128, 8, 2), (128, 128, 16, 2)]
    if level >= 2:
        shapes += [(64, 64, 8, 2), (64, 64, 16, 2), (128, 64, 16, 2), (64, 128, 16, 2), (128, 128, 16, 1)]
    return [dict(zip(DEFAULT, s)) for s in shapes]


def applies(task) -> bool:
    c = match_contraction(task)
    return c is not None and c.a.dtype == dtypes.float32 and c.b.dtype == dtypes.float32


def _layout(prefix: str, op: Operand) -> dict:
    return {f"{prefix}_XS": f"(int64_t){op.x_stride}", f"{prefix}_KS": f"(int64_t){op.k_stride}",
            f"{prefix}_K_CONTIGUOUS": int(op.k_contiguous and not op.x_contiguous)}


def render(task, BM, BN, BK, MIN_BLOCKS=1) -> CudaProgram:
    c: Contraction = match_contraction(task)
    tm, tn = BM // 16, BN // 16
    if tm % 4 or tn % 4 or (BM * BK) % NT or (BN * BK) % NT:
        raise ValueError(f"invalid matmul_simt knobs {BM}x{BN}x{BK}")
    defines = {"BM": BM, "BN": BN, "BK": BK, "MIN_BLOCKS": MIN_BLOCKS, "TM": tm, "TN": tn, "LA": BM * BK // NT, "LB": BN * BK // NT,
               "M": c.M, "N": c.N, "K": c.K, "A_PARAM": c.a.param, "B_PARAM": c.b.param,
               "A_BATCH": c.batch_offset(c.a, "bz"), "B_BATCH": c.batch_offset(c.b, "bz"),
               "PARAMS": c.params, "ARGS": c.args, **_layout("A", c.a), **_layout("B", c.b)}
    head = "".join(f"#define {name} {value}\n" for name, value in defines.items())
    source = CUDA_PRELUDE + c.epilogue + head + KERNEL
    tiles = -(-c.M // BM) * -(-c.N // BN)
    launch = Launch("kiln_matmul_simt", tuple(c.args.split(", ")), (NT, 1, 1), grid=(tiles, 1, c.batch_count))
    return CudaProgram(source, [launch])


TEMPLATE = Template("matmul_simt", ("matmul", "linear"), "cuda", render, priority=10, applies=applies,
                    space=space)
