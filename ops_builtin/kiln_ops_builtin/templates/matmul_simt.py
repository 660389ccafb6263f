"""GEMM-shaped tasks in float32 on the CUDA cores (no TF32): matmul, batched matmul, linear,
and convolutions as implicit GEMM.

A block of 256 threads computes a BM x BN output tile, each thread a TM x TN sub-tile made of
four 4-row x 4-column pieces spread half a tile apart (conflict-free 16-byte shared-memory
reads). K advances BK at a time (over a share of K with split-K,
`kiln_ops_builtin.templates.split_k`) through two shared-memory buffers: the next tile is read
from global memory into registers (as float4s where sizes allow) while the current one is
multiplied. Both operands are stored k-major in shared memory; an operand that is k-contiguous
in memory (A, or B of `linear`) is transposed on the way in. A convolution's operands are read through the core's load hooks
(`kiln.codegen.hooks.match_hooked_gemm`: im2col computed on the fly, padding included).
Outputs go through the core's epilogue hook.

Symbolic sizes (`Template.symbolic`): M, N, K, strides and batch dims are kernel arguments
(`Contraction.sizes`, `HookedGemm.sizes`); `suggest` buckets them by powers of two
(`split_k.bucket`), so the sizes of a bucket share one source.
"""
from __future__ import annotations

from kiln import dtypes
from kiln.codegen.cuda import template_source
from kiln.codegen.hooks import Contraction, HookedGemm, Operand, match_contraction, match_hooked_gemm
from kiln.schedule import Template
from kiln.runtime.cuda import CudaProgram, Launch
from kiln_ops_builtin.templates import split_k

NT = 256
DEFAULT = {"BM": 128, "BN": 128, "BK": 8, "MIN_BLOCKS": 1}

KERNEL = r"""
extern "C" __global__ void __launch_bounds__(256, MIN_BLOCKS) kiln_matmul_simt(PARAMS) {
    __shared__ __align__(16) float As[2][BK][BM];
    __shared__ __align__(16) float Bs[2][BK][BN];
    const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
    const int tiles_n = (N + BN - 1) / BN;
    const int64_t m0 = (int64_t)(blockIdx.x / tiles_n) * BM, n0 = (int64_t)(blockIdx.x % tiles_n) * BN;
    const int64_t bz = blockIdx.z;
#if !HOOKS
    const float* A = A_PARAM + (A_BATCH);
    const float* B = B_PARAM + (B_BATCH);
#endif
    // operand X's tile is BK x BX; each thread copies LX elements of it per k-step, four at a
    // time along the operand's contiguous dimension when VEC
#if VEC
    float4 ra[LA / 4], rb[LB / 4];
#else
    float ra[LA], rb[LB];
#endif
    auto fetch = [&](int64_t k0) {
#pragma unroll
        for (int i = 0; i < LA / W; ++i) {
            const int idx = tid + i * 256;
#if A_K_CONTIGUOUS
            const int x = idx / (BK / W), k = idx % (BK / W) * W;
#else
            const int k = idx / (BM / W), x = idx % (BM / W) * W;
#endif
            const int64_t gx = m0 + x, gk = k0 + k;
            const bool ok = gx < M && gk < K;
#if VEC
            ra[i] = ok ? *(const float4*)&A[gx * A_XS + gk * A_KS] : make_float4(0.f, 0.f, 0.f, 0.f);
#else
            ra[i] = ok ? LOAD_A(gx, gk) : 0.f;
#endif
        }
#pragma unroll
        for (int i = 0; i < LB / W; ++i) {
            const int idx = tid + i * 256;
#if B_K_CONTIGUOUS
            const int x = idx / (BK / W), k = idx % (BK / W) * W;
#else
            const int k = idx / (BN / W), x = idx % (BN / W) * W;
#endif
            const int64_t gx = n0 + x, gk = k0 + k;
            const bool ok = gx < N && gk < K;
#if VEC
            rb[i] = ok ? *(const float4*)&B[gx * B_XS + gk * B_KS] : make_float4(0.f, 0.f, 0.f, 0.f);
#else
            rb[i] = ok ? LOAD_B(gx, gk) : 0.f;
#endif
        }
    };
    // element e of the value a thread copied (a float4 when VEC)
#if VEC
#define KILN_PART(v, e) ((e) == 0 ? (v).x : (e) == 1 ? (v).y : (e) == 2 ? (v).z : (v).w)
#else
#define KILN_PART(v, e) (v)
#endif
    auto stash = [&](int buf) {
#pragma unroll
        for (int i = 0; i < LA / W; ++i) {
            const int idx = tid + i * 256;
#pragma unroll
            for (int e = 0; e < W; ++e) {
#if A_K_CONTIGUOUS
                As[buf][idx % (BK / W) * W + e][idx / (BK / W)] = KILN_PART(ra[i], e);
#else
                As[buf][idx / (BM / W)][idx % (BM / W) * W + e] = KILN_PART(ra[i], e);
#endif
            }
        }
#pragma unroll
        for (int i = 0; i < LB / W; ++i) {
            const int idx = tid + i * 256;
#pragma unroll
            for (int e = 0; e < W; ++e) {
#if B_K_CONTIGUOUS
                Bs[buf][idx % (BK / W) * W + e][idx / (BK / W)] = KILN_PART(rb[i], e);
#else
                Bs[buf][idx / (BN / W)][idx % (BN / W) * W + e] = KILN_PART(rb[i], e);
#endif
            }
        }
    };
    float acc[TM][TN];
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j) acc[i][j] = 0.f;
    const int KT0 = blockIdx.y * KT_SPLIT, KT = min((int)((K + BK - 1) / BK) - KT0, KT_SPLIT);
    fetch((int64_t)KT0 * BK);
    stash(0);
    __syncthreads();
    for (int kt = 0; kt < KT; ++kt) {
        const int cur = kt & 1;
        if (kt + 1 < KT) fetch((int64_t)(KT0 + kt + 1) * BK);
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
            if (m < M && n + 1 < N) KILN_STORE2(bz, m, n, acc[i][j], acc[i][j + 1]);
            else if (m < M && n < N) KILN_STORE(bz, m, n, acc[i][j]);
        }
}
"""


SPLIT_PROBE = {"BM": 64, "BN": 64, "BK": 16, "MIN_BLOCKS": 2, "SPLIT": 2}


def _fit_tile(bm: int, bn: int, bk: int, min_blocks: int) -> split_k.Tile:
    """A tile for `suggest`: 128 FMAs per SM clock, less the shared-memory reads a thread's
    TM x TN FMAs wait on (TM + TN per k)."""
    tm, tn = bm // 16, bn // 16
    return split_k.Tile(dict(zip(DEFAULT, (bm, bn, bk, min_blocks))), bm, bn, bk, 128 * tm * tn / (tm * tn + tm + tn))


FIT_TILES = [_fit_tile(*s) for s in [(128, 128, 8, 1), (128, 64, 8, 2), (64, 128, 8, 2), (64, 64, 16, 2)]]


def space(level: int) -> list[dict]:
    """Level 0: 128x128x8; levels 1 and 2 add other tile sizes, a deeper k-step and split-K."""
    shapes = [(128, 128, 8, 1)]
    if level >= 1:
        shapes += [(128, 128, 8, 2), (128, 64, 8, 2), (64, 128, 8, 2), (128, 128, 16, 2)]
    if level >= 2:
        shapes += [(64, 64, 8, 2), (64, 64, 16, 2), (128, 64, 16, 2), (64, 128, 16, 2), (128, 128, 16, 1)]
    return [dict(zip(DEFAULT, s)) for s in shapes] + ([dict(SPLIT_PROBE)] if level >= 1 else [])


def _gemm(task) -> Contraction | HookedGemm:
    """The GEMM `task` computes: a float32 contraction of plain loads, else through load hooks."""
    c = match_contraction(task)
    return c if c is not None and c.a.dtype == dtypes.float32 else match_hooked_gemm(task)


def suggest(task, sm_count: int) -> list[dict]:
    """Tiles and split-K ranked by `split_k`'s cost model for this shape (symbolic sizes by
    their bucket)."""
    g = _gemm(task)
    batch = g.batch_count if isinstance(g, Contraction) else 1
    return split_k.rank(FIT_TILES, *(split_k.bucket(x) for x in (g.M, g.N, g.K, batch)), sm_count, 4)


def _layout(prefix: str, op: Operand, text) -> dict:
    return {f"{prefix}_XS": f"(int64_t){text(op.x_stride)}", f"{prefix}_KS": f"(int64_t){text(op.k_stride)}",
            f"{prefix}_K_CONTIGUOUS": int(op.k_contiguous and not op.x_contiguous),
            f"LOAD_{prefix}(x, k)": f"{prefix}[(x) * {prefix}_XS + (k) * {prefix}_KS]"}


def _vectorizable(c: Contraction, BM: int, BN: int, BK: int) -> bool:
    """Whether both operands can be copied as aligned float4s along their contiguous dimension."""
    def ok(op: Operand, x_extent: int) -> bool:
        extent = c.K if op.k_contiguous and not op.x_contiguous else x_extent
        return extent % 4 == 0 and all(s % 4 == 0 for s in op.batch_strides)
    return ok(c.a, c.M) and ok(c.b, c.N) and (BM * BK) % 1024 == 0 and (BN * BK) % 1024 == 0


def _plain_defines(c: Contraction, BM: int, BN: int, BK: int) -> dict:
    """Operands read straight from memory (float32 matmul, batched matmul, linear)."""
    vec = int(_vectorizable(c, BM, BN, BK))
    return {"HOOKS": 0, "VEC": vec, "W": 4 if vec else 1, "A_PARAM": c.a.param, "B_PARAM": c.b.param,
            "A_BATCH": c.batch_offset(c.a, "bz"), "B_BATCH": c.batch_offset(c.b, "bz"),
            **_layout("A", c.a, c.text), **_layout("B", c.b, c.text)}


def _hook_defines(g: HookedGemm) -> dict:
    """Operands read through the core's load hooks (convolutions: im2col on the fly). Threads
    walk A along m (neighbouring output pixels) and B along k (a filter's contiguous taps)."""
    return {"HOOKS": 1, "VEC": 0, "W": 1, "A_K_CONTIGUOUS": 0, "B_K_CONTIGUOUS": 1,
            "LOAD_A(x, k)": f"kiln_load_a({g.args}, (x), (k))", "LOAD_B(x, k)": f"kiln_load_b({g.args}, (k), (x))"}


def applies(task) -> bool:
    c = match_contraction(task)
    if c is not None:
        return c.a.dtype == dtypes.float32 and c.b.dtype == dtypes.float32
    g = match_hooked_gemm(task)
    return g is not None and g.acc_dtype == dtypes.float32


def render(task, BM, BN, BK, MIN_BLOCKS=1, SPLIT=1) -> CudaProgram:
    tm, tn = BM // 16, BN // 16
    if tm % 4 or tn % 4 or (BM * BK) % NT or (BN * BK) % NT:
        raise ValueError(f"invalid matmul_simt knobs {BM}x{BN}x{BK}")
    g = _gemm(task)
    if isinstance(g, Contraction):
        batch, hooks, defines = g.batch_count, g.epilogue, _plain_defines(g, BM, BN, BK)
    else:
        batch, hooks, defines = 1, g.hooks, _hook_defines(g)
    names, temporaries = tuple(g.args.split(", ")), []
    sk = split_k.plan(SPLIT, g.M, g.N, g.K, BK, batch, g.params, names, temporaries, text=g.text)
    defines.update({"BM": BM, "BN": BN, "BK": BK, "MIN_BLOCKS": MIN_BLOCKS, "TM": tm, "TN": tn,
                    "LA": BM * BK // NT, "LB": BN * BK // NT, "M": g.text(g.M), "N": g.text(g.N), "K": g.text(g.K),
                    "ARGS": g.args, **sk.defines})
    tiles = int(-(-g.M // BM) * -(-g.N // BN))
    launch = Launch("kiln_matmul_simt", names + sk.args, (NT, 1, 1), grid=(tiles, SPLIT, int(batch)))
    return CudaProgram(template_source([KERNEL, sk.source], defines, hooks), [launch, *sk.launches], temporaries,
                       alignment=16, sizes=g.sizes.values)


TEMPLATE = Template("matmul_simt", ("matmul", "linear", "conv1d", "conv2d", "conv_transpose2d"), "cuda",
                    render, priority=10, applies=applies, space=space, suggest=suggest, reads_views=True,
                    symbolic=True)
