// The matrix-vector product of kiln_ops_builtin.templates.gemv (its docstring tells the
// algorithm): out[m][n] = sum over k of a[m][k] * b[n][k], for Rows <= 4 rows of a.
//
// Compile-time knobs, the template parameters of kiln::gemv::run (gemv.py's knobs: R is
// Cols, KW is KWarps, PREFETCH is Prefetch): the element type (F32, F16, BF16), Rows (a's rows:
// the accumulators), Cols (columns n per warp), KWarps (warps of a block splitting K), Warps
// (per block), Prefetch (steps of the k loop whose b vectors a thread brings into L2 before it
// waits for the grids before it with kiln_wait_prior_grids() -- at 0 the runtime's wait comes
// first).
// Run-time problem (kiln::gemv::Problem): N, K, the rows' strides, and the 16-byte vectors of
// K that each split takes (split-K over blocks). Each finished column goes to store(m, n, value),
// which the rendered kernel makes split_k's (kiln_split_k_tiles: the epilogue hook, a partial).
//
// Needs the CUDA prelude (fixed-width integers, kiln_h2f, kiln_bf2f) and the PTX wrappers
// PRIOR_GRIDS and PREFETCH_L2 ahead of it.

namespace kiln::gemv {

// How an element type is stored (16-bit floats as raw bits) and how a 32-bit word of them is
// read as floats.
struct F32 {
    using storage = float;
    static __device__ __forceinline__ void unpack(uint32_t w, float* f) { f[0] = __uint_as_float(w); }
};

struct F16 {
    using storage = uint16_t;
    static __device__ __forceinline__ void unpack(uint32_t w, float* f) {
        f[0] = kiln_h2f((uint16_t)(w & 0xffffu));
        f[1] = kiln_h2f((uint16_t)(w >> 16));
    }
};

struct BF16 {
    using storage = uint16_t;
    static __device__ __forceinline__ void unpack(uint32_t w, float* f) {
        f[0] = kiln_bf2f((uint16_t)(w & 0xffffu));
        f[1] = kiln_bf2f((uint16_t)(w >> 16));
    }
};

struct Problem {
    int64_t n, k;                // output columns, reduction length (elements)
    int64_t a_stride, b_stride;  // elements from one row of a (m) to the next, of b (n)
    int chunks_per_split;        // 16-byte vectors of K per split
};

// One 16-byte vector of neighbouring k of one row, as floats
template <typename Elem>
static __device__ __forceinline__ void vector(const typename Elem::storage* p, float* f) {
    const uint4 u = __ldg((const uint4*)p);
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
    constexpr int per_word = 4 / sizeof(typename Elem::storage);
#pragma unroll
    for (int i = 0; i < 4; ++i) Elem::unpack(w[i], f + i * per_word);
}

// The block's columns: tile picks Cols * Warps / KWarps of them, split the split of K. a and b
// point at this batch's operands (a: Rows x K, b: N x K, k contiguous).
template <typename Elem, int Rows, int Cols, int KWarps, int Warps, int Prefetch, typename Store>
static __device__ __forceinline__ void run(const typename Elem::storage* a, const typename Elem::storage* b,
                                           const Problem& p, int64_t tile, int split, Store store) {
    constexpr int vec = 16 / sizeof(typename Elem::storage);
    __shared__ float partial[Warps][Rows][Cols];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, kw = warp % KWarps;
    const int64_t n0 = (tile * (Warps / KWarps) + warp / KWarps) * Cols;
    const int c1 = min((int)(p.k / vec), (split + 1) * p.chunks_per_split);
    const int c0 = split * p.chunks_per_split + kw * 32 + lane;
    if constexpr (Prefetch > 0) {
#pragma unroll
        for (int i = 0; i < Prefetch; ++i)
#pragma unroll
            for (int r = 0; r < Cols; ++r) {
                const int c = c0 + i * 32 * KWarps;
                if (c < c1 && n0 + r < p.n) kiln_prefetch_l2(b + (n0 + r) * p.b_stride + (int64_t)c * vec);
            }
        kiln_wait_prior_grids(true);
    }
    float acc[Rows][Cols];
#pragma unroll
    for (int m = 0; m < Rows; ++m)
#pragma unroll
        for (int r = 0; r < Cols; ++r) acc[m][r] = 0.f;
    for (int c = c0; c < c1; c += 32 * KWarps) {
        float w[Cols][vec];
#pragma unroll
        for (int r = 0; r < Cols; ++r) {
            if (n0 + r < p.n) vector<Elem>(b + (n0 + r) * p.b_stride + (int64_t)c * vec, w[r]);
            else
#pragma unroll
                for (int e = 0; e < vec; ++e) w[r][e] = 0.f;
        }
#pragma unroll
        for (int m = 0; m < Rows; ++m) {
            float x[vec];
            vector<Elem>(a + m * p.a_stride + (int64_t)c * vec, x);
#pragma unroll
            for (int r = 0; r < Cols; ++r)
#pragma unroll
                for (int e = 0; e < vec; ++e) acc[m][r] = fmaf(x[e], w[r][e], acc[m][r]);
        }
    }
#pragma unroll
    for (int m = 0; m < Rows; ++m)
#pragma unroll
        for (int r = 0; r < Cols; ++r)
#pragma unroll
            for (int s = 16; s > 0; s /= 2) acc[m][r] += __shfl_xor_sync(0xffffffffu, acc[m][r], s);
    if (KWarps > 1) {
        if (lane == 0)
#pragma unroll
            for (int m = 0; m < Rows; ++m)
#pragma unroll
                for (int r = 0; r < Cols; ++r) partial[warp][m][r] = acc[m][r];
        __syncthreads();
        if (kw != 0) return;
#pragma unroll
        for (int m = 0; m < Rows; ++m)
#pragma unroll
            for (int r = 0; r < Cols; ++r)
                for (int j = 1; j < KWarps; ++j) acc[m][r] += partial[warp + j][m][r];
    }
#pragma unroll
    for (int m = 0; m < Rows; ++m)
#pragma unroll
        for (int r = 0; r < Cols; ++r)
            if (lane == (m * Cols + r) % 32 && n0 + r < p.n) store(m, n0 + r, acc[m][r]);
}

}  // namespace kiln::gemv
