"""Matrix-vector products: matmul and linear with at most 4 rows per batch (decoding).

With M <= 4 a GEMM is a stream over B: each of its elements is used M times, so the kernel's
speed is the memory bandwidth at which it reads B, and tensor-core tiles of 64 rows would waste
most of their work. Each warp owns R columns n (rows of a linear layer's weight, contiguous
along K), its lanes stride over K in 16-byte vectors, and the M rows of A ride along: every
loaded vector of B is multiplied by the M matching vectors of A (small, cached) into M x R float32
accumulators. KW warps of a block split K between them and add through shared memory; SPLIT > 1
splits K over blocks as well (`split_k`: float32 partials, then the sum kernel), for grids that
would not fill the GPU. A warp-shuffle sum ends each column, and the core's epilogue hooks
write it (bias, activations, casts fused as everywhere).

Declines (the GEMM templates take over): M > 4 (on an H200 at M = 16 this kernel reached
0.22-0.5 of cuBLAS: the M loads of A per vector of B dominate), an operand whose K is not contiguous, K or a
stride not a multiple of one 16-byte vector, dtypes other than float16, bfloat16 and float32.

Symbolic sizes (`Template.symbolic`): N, K, strides and batch dims are kernel arguments
(`Contraction.sizes`); M sizes the accumulator arrays, so each M (1 to 4) has its own source.
`suggest` buckets symbolic sizes by powers of two (`split_k.bucket`).
"""
from __future__ import annotations

from kiln.template import Contraction, CudaProgram, Launch, Template, dtypes, match_contraction, template_source
from kiln_ops_builtin.templates import split_k

MAX_M = 4
WARPS = 8
MAX_GRID_Z = 65535
UNPACK = {dtypes.float16: "kiln_h2f", dtypes.bfloat16: "kiln_bf2f", dtypes.float32: None}

KERNEL = r"""
// VEC neighbouring k of one row of an operand, as floats
static __device__ __forceinline__ void kiln_gemv_vector(const ELEM* p, float* f) {
    const uint4 u = __ldg((const uint4*)p);
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#if VEC == 8
        f[2 * i] = TO_FLOAT((uint16_t)(w[i] & 0xffffu));
        f[2 * i + 1] = TO_FLOAT((uint16_t)(w[i] >> 16));
#else
        f[i] = __uint_as_float(w[i]);
#endif
    }
}

extern "C" __global__ void __launch_bounds__(32 * WARPS) kiln_gemv(PARAMS) {
    __shared__ float partial[WARPS][M][R];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, kw = warp % KW;
    const int64_t n0 = ((int64_t)blockIdx.x * (WARPS / KW) + warp / KW) * R;
    const int64_t bz = blockIdx.z;
    const ELEM* a = (const ELEM*)A_PARAM + (A_BATCH);
    const ELEM* b = (const ELEM*)B_PARAM + (B_BATCH);
    float acc[M][R];
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
        for (int r = 0; r < R; ++r) acc[m][r] = 0.f;
    const int c1 = min((int)(K / VEC), (int)(blockIdx.y + 1) * CHUNKS_SPLIT);
    for (int c = blockIdx.y * CHUNKS_SPLIT + kw * 32 + lane; c < c1; c += 32 * KW) {
        float w[R][VEC];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            if (n0 + r < N) kiln_gemv_vector(b + (n0 + r) * B_XS + (int64_t)c * VEC, w[r]);
            else
#pragma unroll
                for (int e = 0; e < VEC; ++e) w[r][e] = 0.f;
        }
#pragma unroll
        for (int m = 0; m < M; ++m) {
            float x[VEC];
            kiln_gemv_vector(a + m * A_XS + (int64_t)c * VEC, x);
#pragma unroll
            for (int r = 0; r < R; ++r)
#pragma unroll
                for (int e = 0; e < VEC; ++e) acc[m][r] = fmaf(x[e], w[r][e], acc[m][r]);
        }
    }
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int s = 16; s > 0; s /= 2) acc[m][r] += __shfl_xor_sync(0xffffffffu, acc[m][r], s);
    if (KW > 1) {
        if (lane == 0)
#pragma unroll
            for (int m = 0; m < M; ++m)
#pragma unroll
                for (int r = 0; r < R; ++r) partial[warp][m][r] = acc[m][r];
        __syncthreads();
        if (kw != 0) return;
#pragma unroll
        for (int m = 0; m < M; ++m)
#pragma unroll
            for (int r = 0; r < R; ++r)
                for (int j = 1; j < KW; ++j) acc[m][r] += partial[warp + j][m][r];
    }
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
        for (int r = 0; r < R; ++r)
            if (lane == (m * R + r) % 32 && n0 + r < N) KILN_STORE(bz, m, n0 + r, acc[m][r]);
}
"""


def _vec(c: Contraction) -> int:
    return 16 // c.a.dtype.nbytes


def applies(task) -> bool:
    c = match_contraction(task)
    if c is None or c.a.dtype != c.b.dtype or c.a.dtype not in UNPACK or not 0 < c.M <= MAX_M:
        return False
    vec = _vec(c)
    return (c.K % vec == 0 and c.a.k_contiguous and c.b.k_contiguous and c.batch_count <= MAX_GRID_Z
            and all(s % vec == 0 for op in (c.a, c.b) for s in (op.x_stride, *op.batch_strides)))


def space(level: int) -> list[dict]:
    """Level 0: two columns per warp, K split over four warps (where no GPU is asked for
    `suggest`); 1 and 2 add columns per warp, K split over a block's warps and over blocks."""
    if level == 0:
        return [{"R": 2, "KW": 4}]
    out = [{"R": r, "KW": kw} for r in (1, 2, 4) for kw in (1, 2, 4, 8)]
    if level == 2:
        out += [{"R": r, "KW": 8, "SPLIT": s} for r in (1, 2) for s in (2, 4, 8)]
    return out


def suggest(task, sm_count: int) -> list[dict]:
    """Two columns per warp; the fewest K-splitting warps that still give two blocks per SM;
    split over blocks when even eight do not fill one wave (at least two vectors per lane and
    split)."""
    c = match_contraction(task)
    N, K, batch = (split_k.bucket(x) for x in (c.N, c.K, c.batch_count))
    r = 2
    blocks = lambda kw: -(-N // (WARPS // kw * r)) * batch
    kw = next((k for k in (1, 2, 4) if blocks(k) >= 2 * sm_count), 8)
    first = {"R": r, "KW": kw}
    split = min(-(-sm_count // blocks(kw)), K // _vec(c) // (32 * kw * 2))
    if blocks(kw) < sm_count and split > 1:
        first["SPLIT"] = split
    return [first] + [k for k in space(1) if k != first]


def render(task, R, KW, SPLIT=1) -> CudaProgram:
    c: Contraction = match_contraction(task)
    if R not in (1, 2, 4) or KW not in (1, 2, 4, 8):
        raise ValueError(f"gemv: R must be 1, 2 or 4 and KW 1, 2, 4 or 8, got R={R}, KW={KW}")
    vec, args, temporaries = _vec(c), tuple(c.args.split(", ")), []
    chunks = c.K // vec
    split = max(1, min(SPLIT, chunks))
    sk = split_k.plan(split, c.M, c.N, chunks, 1, c.batch_count, c.params, args, temporaries, text=c.text)
    defines = {
        "M": int(c.M), "N": c.text(c.N), "K": c.text(c.K), "R": R, "KW": KW, "WARPS": WARPS, "VEC": vec,
        "ELEM": "float" if c.a.dtype == dtypes.float32 else "uint16_t", "TO_FLOAT(h)": f"{UNPACK[c.a.dtype]}(h)",
        "A_PARAM": c.a.param, "B_PARAM": c.b.param, "A_XS": f"(int64_t){c.text(c.a.x_stride)}",
        "B_XS": f"(int64_t){c.text(c.b.x_stride)}", "A_BATCH": c.batch_offset(c.a, "bz"),
        "B_BATCH": c.batch_offset(c.b, "bz"), "CHUNKS_SPLIT": sk.defines["KT_SPLIT"], "ARGS": c.args, **sk.defines,
    }
    columns = WARPS // KW * R
    launch = Launch("kiln_gemv", args + sk.args, (32 * WARPS, 1, 1),
                    grid=(int(-(-c.N // columns)), split, int(c.batch_count)))
    return CudaProgram(template_source([KERNEL, sk.source], defines, c.epilogue), [launch, *sk.launches], temporaries,
                       alignment=16, sizes=c.sizes.values)


TEMPLATE = Template("gemv", ("matmul", "linear"), "cuda", render, priority=40, applies=applies, space=space,
                    suggest=suggest, reads_views=True, symbolic=True)
