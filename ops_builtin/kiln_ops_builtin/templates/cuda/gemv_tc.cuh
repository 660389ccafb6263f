// The skinny matrix product of kiln_ops_builtin.templates.gemv_tc (its docstring tells the
// algorithm): out[m][n] = sum over k of a[m][k] * b[n][k] for Rows of 5 to 16 of a, 16-bit
// floats, on mma.sync.m16n8k16 with b's rows as the tensor core's rows.
//
// Compile-time knobs, the template parameters of kiln::gemv_tc::run (gemv_tc.py's knobs: KW is
// KWarps, PREFETCH is Prefetch): the element type (F16, BF16: its mma), Rows, KWarps (warps of a
// block splitting K), Warps (per block), Prefetch (steps of the k loop whose b vectors a thread
// brings into L2 before it waits for the grids before it with kiln_wait_prior_grids() -- at 0
// the runtime's wait comes first). Run-time problem (kiln::gemv_tc::Problem): N, K, the rows'
// strides, and the 32-element groups of K that each split takes (split-K over blocks). Each finished
// element goes to store(m, n, value), which the rendered kernel makes split_k's (kiln_split_k_tiles:
// the epilogue hook, a partial).
//
// Needs the CUDA prelude and the PTX wrappers MMA (kiln_mma_m16n8k16_f16, _bf16), PRIOR_GRIDS
// and PREFETCH_L2 ahead of it.

namespace kiln::gemv_tc {

struct F16 {
    static __device__ __forceinline__ void mma(float* d, const unsigned* a, const unsigned* b) {
        kiln_mma_m16n8k16_f16(d, a, b);
    }
};

struct BF16 {
    static __device__ __forceinline__ void mma(float* d, const unsigned* a, const unsigned* b) {
        kiln_mma_m16n8k16_bf16(d, a, b);
    }
};

struct Problem {
    int64_t n, k;                // output columns, reduction length (elements, a multiple of 8)
    int64_t a_stride, b_stride;  // elements from one row of a (m) to the next, of b (n)
    int64_t groups_per_split;    // 32-element groups of K per split
};

constexpr int UNROLL = 4;        // groups of K whose loads are in flight together

// The 8 elements at row + k .. row + k + 7 (zeros where the row or k is past the end)
static __device__ __forceinline__ uint4 eight(const uint16_t* row, int64_t k, bool inside) {
    return inside ? __ldg((const uint4*)(row + k)) : make_uint4(0u, 0u, 0u, 0u);
}

// The block's columns: tile picks 16 * Warps / KWarps of them (16 a warp: the mma's rows), split
// the split of K. a and b point at this batch's operands (a: Rows x K, b: N x K, k
// contiguous). The sum over k is order-free, so each lane's 16-byte vector of k (8c .. 8c + 7 of
// a 32-element group, c = lane % 4) is its slice of two mma k-steps: elements 8c, 8c + 1 and
// 8c + 2, 8c + 3 are the fragment's k = 2c, 2c + 1 and 2c + 8, 2c + 9 of the first step, the
// next four those of the second, in a's fragments and b's alike.
template <typename Elem, int Rows, int KWarps, int Warps, int Prefetch, typename Store>
static __device__ __forceinline__ void run(const uint16_t* a, const uint16_t* b, const Problem& p, int64_t tile,
                                           int split, Store store) {
    constexpr int Tiles = (Rows + 7) / 8;
    __shared__ float partial[KWarps > 1 ? Warps : 1][Tiles][4][32];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, kw = warp % KWarps;
    const int g = lane / 4, c = lane % 4;
    const int64_t n0 = (tile * (Warps / KWarps) + warp / KWarps) * 16;
    const bool has0 = n0 + g < p.n, has1 = n0 + g + 8 < p.n;
    const uint16_t* b0 = b + (has0 ? n0 + g : 0) * p.b_stride + 8 * c;
    const uint16_t* b1 = b + (has1 ? n0 + g + 8 : 0) * p.b_stride + 8 * c;
    const uint16_t* as[Tiles];
#pragma unroll
    for (int t = 0; t < Tiles; ++t) as[t] = a + (8 * t + g < Rows ? 8 * t + g : 0) * p.a_stride + 8 * c;
    float acc[Tiles][4];
#pragma unroll
    for (int t = 0; t < Tiles; ++t)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[t][i] = 0.f;
    const int64_t groups = (p.k + 31) / 32;
    const int64_t q1 = min(groups, (int64_t)(split + 1) * p.groups_per_split);
    const int64_t q0 = (int64_t)split * p.groups_per_split + kw;
    if constexpr (Prefetch > 0) {
#pragma unroll
        for (int u = 0; u < Prefetch * UNROLL; ++u) {
            const int64_t k0 = (q0 + u * KWarps) * 32;
            if (q0 + u * KWarps < q1 && k0 + 8 * c < p.k) {
                if (has0) kiln_prefetch_l2(b0 + k0);
                if (has1) kiln_prefetch_l2(b1 + k0);
            }
        }
        kiln_wait_prior_grids(true);
    }
    for (int64_t q = q0; q < q1; q += UNROLL * KWarps) {
        uint4 w0[UNROLL], w1[UNROLL], x[UNROLL][Tiles];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int64_t k0 = (q + u * KWarps) * 32;
            const bool in_k = q + u * KWarps < q1 && k0 + 8 * c < p.k;
            w0[u] = eight(b0, k0, has0 && in_k);
            w1[u] = eight(b1, k0, has1 && in_k);
#pragma unroll
            for (int t = 0; t < Tiles; ++t) x[u][t] = eight(as[t], k0, 8 * t + g < Rows && in_k);
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const unsigned first[4] = {w0[u].x, w1[u].x, w0[u].y, w1[u].y};
            const unsigned second[4] = {w0[u].z, w1[u].z, w0[u].w, w1[u].w};
#pragma unroll
            for (int t = 0; t < Tiles; ++t) {
                const unsigned xf[2] = {x[u][t].x, x[u][t].y}, xs[2] = {x[u][t].z, x[u][t].w};
                Elem::mma(acc[t], first, xf);
                Elem::mma(acc[t], second, xs);
            }
        }
    }
    if (KWarps > 1) {
#pragma unroll
        for (int t = 0; t < Tiles; ++t)
#pragma unroll
            for (int i = 0; i < 4; ++i) partial[warp][t][i][lane] = acc[t][i];
        __syncthreads();
        if (kw != 0) return;
#pragma unroll
        for (int t = 0; t < Tiles; ++t)
#pragma unroll
            for (int i = 0; i < 4; ++i)
                for (int j = 1; j < KWarps; ++j) acc[t][i] += partial[warp + j][t][i][lane];
    }
    // the accumulator's element i of tile t: column n0 + g (+ 8 for i >= 2), row 8t + 2c (+ 1 for odd i)
#pragma unroll
    for (int t = 0; t < Tiles; ++t)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int m = 8 * t + 2 * c + (i & 1);
            const int64_t n = n0 + g + 8 * (i >> 1);
            if (m < Rows && n < p.n) store(m, n, acc[t][i]);
        }
}

}  // namespace kiln::gemv_tc
