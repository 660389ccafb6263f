// Convolution as implicit GEMM on tensor cores, for kiln_ops_builtin.templates.conv_tc (its
// docstring tells the algorithm): a block's Bm x Bn tile of out[m][n] = sum over k of
// a(m, k) * b(k, n), with a and b read through the core's load hooks (im2col and zero padding on
// the fly) and each result handed to the store hooks.
//
// Compile-time knobs, the template parameters of kiln::conv_tc::run (conv_tc.py's knobs: BM is
// Bm, ...): the 16-bit element type (kiln::mma_sync::F16, BF16), the block tile Bm x Bn, the
// warp tile Wm x Wn, the k-step Bk. Run-time problem (kiln::conv_tc::Problem): M, N, K and the k-steps each
// blockIdx.y takes (split-K over blocks).
//
// Needs, ahead of it, the CUDA prelude, the PTX wrappers LDMATRIX and MMA, and mma_sync.cuh (the
// element types; kiln::mma_sync::step, one Bk-deep step of a warp's tile, shared with matmul_tc).

namespace kiln::conv_tc {

struct Problem {
    int64_t m, n, k;     // the GEMM's rows (output pixels), columns (output channels), reduction
    int k_steps;         // Bk-deep steps of K per blockIdx.y
};

// The block's tile: blockIdx.x picks it (row tiles by column tiles), blockIdx.y the split of K.
// `as_` and `bs_` are the double-buffered shared-memory tiles (k-major, swizzled); problem()
// gives the Problem, evaluated where a size is read, as a macro would be (evaluated once up
// front, a symbolic size's arithmetic moves and the machine code changes); load_a(m, k) and
// load_b(k, n) read the operands as floats; store(m, n, v) and store2(m, n, v0, v1) (n even,
// n + 1 < N) take the results.
template <typename Elem, int Bm, int Bn, int Bk, int Wm, int Wn, typename ProblemOf, typename LoadA, typename LoadB,
          typename Store, typename Store2>
static __device__ __forceinline__ void run(uint16_t (&as_)[2][Bm * Bk], uint16_t (&bs_)[2][Bn * Bk], ProblemOf problem,
                                           LoadA load_a, LoadB load_b, Store store, Store2 store2) {
    constexpr int threads = (Bm / Wm) * (Bn / Wn) * 32, la = Bm * Bk / 8 / threads, lb = Bn * Bk / 8 / threads;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp / (Bn / Wn), wn = warp % (Bn / Wn);
    const int tiles_n = (problem().n + Bn - 1) / Bn;
    const int64_t m0 = (int64_t)(blockIdx.x / tiles_n) * Bm, n0 = (int64_t)(blockIdx.x % tiles_n) * Bn;
    const int KT = (problem().k + Bk - 1) / Bk, kt0 = blockIdx.y * problem().k_steps,
              kt1 = min(KT, kt0 + problem().k_steps);
    auto pack = [](float lo, float hi) { return Elem::bits(lo) | (Elem::bits(hi) << 16); };
    // a thread reads eight neighbouring k of one row per copy: A's rows (output pixels) vary
    // fastest across threads, so the input's neighbouring pixels are read together. GEMM indices
    // are below 2^31: passed to the hooks zero-extended from 32 bits, so that the compiler can
    // narrow the hooks' index divisions (im2col) to 32-bit arithmetic (written out here: through
    // a function, the machine code differs)
    uint4 ra[la], rb[lb];
    auto fetch = [&](int kt) {
#pragma unroll
        for (int i = 0; i < la; ++i) {
            const int idx = tid + i * threads, r = idx % Bm, c = idx / Bm;
            const int64_t gm = m0 + r, gk = (int64_t)kt * Bk + c * 8;
            float v[8];
#pragma unroll
            for (int e = 0; e < 8; ++e)
                v[e] = gm < problem().m && gk + e < problem().k
                           ? load_a((int64_t)(uint32_t)gm, (int64_t)(uint32_t)(gk + e)) : 0.f;
            ra[i] = make_uint4(pack(v[0], v[1]), pack(v[2], v[3]), pack(v[4], v[5]), pack(v[6], v[7]));
        }
#pragma unroll
        for (int i = 0; i < lb; ++i) {
            const int idx = tid + i * threads, r = idx / (Bk / 8), c = idx % (Bk / 8);
            const int64_t gn = n0 + r, gk = (int64_t)kt * Bk + c * 8;
            float v[8];
#pragma unroll
            for (int e = 0; e < 8; ++e)
                v[e] = gn < problem().n && gk + e < problem().k
                           ? load_b((int64_t)(uint32_t)(gk + e), (int64_t)(uint32_t)gn) : 0.f;
            rb[i] = make_uint4(pack(v[0], v[1]), pack(v[2], v[3]), pack(v[4], v[5]), pack(v[6], v[7]));
        }
    };
    auto stash = [&](int buf) {
#pragma unroll
        for (int i = 0; i < la; ++i) {
            const int idx = tid + i * threads, r = idx % Bm, c = idx / Bm;
            *(uint4*)&as_[buf][r * Bk + kiln_swz(r, c, Bk / 8) * 8] = ra[i];
        }
#pragma unroll
        for (int i = 0; i < lb; ++i) {
            const int idx = tid + i * threads, r = idx / (Bk / 8), c = idx % (Bk / 8);
            *(uint4*)&bs_[buf][r * Bk + kiln_swz(r, c, Bk / 8) * 8] = rb[i];
        }
    };
    float acc[Wm / 16][Wn / 8][4];
#pragma unroll
    for (int i = 0; i < Wm / 16; ++i)
#pragma unroll
        for (int j = 0; j < Wn / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;
    if (kt0 < kt1) {
        fetch(kt0);
        stash(0);
    }
    __syncthreads();
    for (int kt = kt0; kt < kt1; ++kt) {
        const int cur = (kt - kt0) & 1;
        if (kt + 1 < kt1) fetch(kt + 1);
        const uint16_t* as = as_[cur];
        const uint16_t* bs = bs_[cur];
        kiln::mma_sync::step<Elem, Bk, Bn, Wm, Wn, true>(acc, as, bs, wm, wn, lane);
        if (kt + 1 < kt1) stash(cur ^ 1);
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < Wm / 16; ++i)
#pragma unroll
        for (int j = 0; j < Wn / 8; ++j)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int64_t m = m0 + wm * Wm + i * 16 + (lane >> 2) + h * 8;
                const int64_t n = n0 + wn * Wn + j * 8 + (lane & 3) * 2;
                if (m < problem().m && n + 1 < problem().n) store2(m, n, acc[i][j][2 * h], acc[i][j][2 * h + 1]);
                else if (m < problem().m && n < problem().n) store(m, n, acc[i][j][2 * h]);
            }
}

}  // namespace kiln::conv_tc
