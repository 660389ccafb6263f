// The kernel of kiln_ops_builtin.templates.matmul_simt (its docstring tells the algorithm), on
// matmul_simt.cuh's pieces: a block's BM x BN tile of out[b][m][n] = sum over k of a(m, k) *
// b(n, k) (blockIdx.x picks it, in groups of GROUP_M rows of tiles; blockIdx.y the split of K;
// blockIdx.z the batch b), each result handed to split_k's kiln_store / kiln_store2 (the core's
// epilogue hooks where K is not split).
//
// Needs, ahead of it, the program's kiln_matmul_simt_program (matmul_simt.py renders it):
//   Tile, A, B        kiln::matmul_simt::Tile<...> (the knobs), the operands' kinds (Plain<...>, Hooked)
//   a(ARGS, ...)      A as its kind takes it: (bz) -> Operand, or (x, k) -> float; b(ARGS, ...) B's
// and split_k's M, N, K (run-time where symbolic), KT_SPLIT (k-tiles per blockIdx.y), its stores,
// PARAMS, ARGS and KERNEL_ARGS.
//
// The kernel's code is written here in the kernel itself, not in a function that it calls:
// NVRTC's optimizer meets a called function before it is inlined and the machine code changes
// (registers numbered differently; where a size is symbolic, other instructions). For the same
// reason the copies' fetch and stash are written out where they happen (as lambdas, other
// instructions where a size is symbolic; as functions, where an operand comes by cp.async).
extern "C" __global__ void __launch_bounds__(256, kiln_matmul_simt_program::Tile::MIN_BLOCKS) kiln_matmul_simt(PARAMS) {
    using P = kiln_matmul_simt_program;
    using T = P::Tile;
    using A = P::A;
    using B = P::B;
    namespace ks = kiln::matmul_simt;
    constexpr int BM = T::BM, BN = T::BN, BK = T::BK, WM = T::WM, WN = T::WN, STAGES = T::STAGES, FRAG = T::FRAG;
    constexpr int LM = T::LM, LN = T::LN, TM = T::TM, TN = T::TN, GROUP_M = T::GROUP_M;
    constexpr bool ASYNC = A::ASYNC || B::ASYNC;
    __shared__ __align__(16) float As[STAGES][BK][BM + 4];
    __shared__ __align__(16) float Bs[STAGES][BK][BN + 4];
    const int tid = threadIdx.x;
    const int tiles_m = (int)((M + BM - 1) / BM), tiles_n = (int)((N + BN - 1) / BN);
    const int group = blockIdx.x / (GROUP_M * tiles_n), first = group * GROUP_M;
    const int rows = min(tiles_m - first, GROUP_M), r = blockIdx.x % (GROUP_M * tiles_n);
    const int64_t m0 = (int64_t)(first + r % rows) * BM, n0 = (int64_t)(r / rows) * BN;
    const int64_t bz = blockIdx.z;
    const int KT0 = blockIdx.y * KT_SPLIT,
              KT = min((int)((K + BK - 1) / BK) - KT0, KT_SPLIT);
    const int64_t k_first = (int64_t)KT0 * BK;
    // the operands as their kinds take them: P::a(ARGS, bz), an Operand, where Plain; P::a(ARGS,
    // x, k), a float, where Hooked (the indices passed by reference: by value, the batch's
    // offset is computed at another place)
    auto of_a = [&](const auto&... i) { return P::a(ARGS, i...); };
    auto of_b = [&](const auto&... i) { return P::b(ARGS, i...); };
    typename A::template Copy<BK, BM, 0, decltype(of_a)> ca(of_a, bz, m0, M, K, k_first);
    typename B::template Copy<BK, BN, 1, decltype(of_b)> cb(of_b, bz, n0, N, K, k_first);
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
            // k-tile s into stage s: cp.async copies land there (one group a k-tile), the others
            // wait in registers for stash
            if constexpr (A::ASYNC) ca.async(As[s], (int64_t)(KT0 + s) * BK);
            else ca.fetch((int64_t)(KT0 + s) * BK);
            if constexpr (B::ASYNC) cb.async(Bs[s], (int64_t)(KT0 + s) * BK);
            else cb.fetch((int64_t)(KT0 + s) * BK);
            if constexpr (!A::ASYNC) ca.stash(As[s]);
            if constexpr (!B::ASYNC) cb.stash(Bs[s]);
        }
        ks::commit<ASYNC>();
    }
    ks::landed<ASYNC, STAGES>();
    __syncthreads();
    // a thread's fragments of k-step k of stage s into register set f (two sets where FRAG: the
    // next k-step's are read while the current one's FMAs run, across k-tiles too)
    float a[FRAG + 1][TM], b[FRAG + 1][TN];
    auto fragment = [&](int f, int s, int k) {
#pragma unroll
        for (int p = 0; p < TM / 4; ++p) *(float4*)&a[f][p * 4] = *(const float4*)&As[s][k][wm + p * 4 * LM];
#pragma unroll
        for (int p = 0; p < TN / 4; ++p) *(float4*)&b[f][p * 4] = *(const float4*)&Bs[s][k][wn + p * 4 * LN];
    };
    // the end of k-tile kt's reads of shared memory: k-tile kt + STAGES - 1 stashed into the
    // stage kt - 1 left (every thread passed its reads at the last barrier), kt + 1 landed
    auto tile_end = [&](bool ahead, int last) {
        if (ahead) {
            if constexpr (!A::ASYNC) ca.stash(As[last]);
            if constexpr (!B::ASYNC) cb.stash(Bs[last]);
        }
        ks::landed<ASYNC, STAGES>();
        __syncthreads();
    };
    if constexpr (FRAG) fragment(0, 0, 0);
    for (int kt = 0; kt < KT; ++kt) {
        const int cur = kt % STAGES, last = (kt + STAGES - 1) % STAGES;
        const bool ahead = kt + STAGES - 1 < KT;
        if (ahead) {        // k-tile kt + STAGES - 1 into the stage kt - 1 left
            if constexpr (A::ASYNC) ca.async(As[last], (int64_t)(KT0 + (kt + STAGES - 1)) * BK);
            else ca.fetch((int64_t)(KT0 + (kt + STAGES - 1)) * BK);
            if constexpr (B::ASYNC) cb.async(Bs[last], (int64_t)(KT0 + (kt + STAGES - 1)) * BK);
            else cb.fetch((int64_t)(KT0 + (kt + STAGES - 1)) * BK);
        }
        ks::commit<ASYNC>();
#pragma unroll
        for (int k = 0; k < BK; ++k) {
            if constexpr (!FRAG) {
                fragment(0, cur, k);
            } else if (k + 1 < BK) {
                fragment((k + 1) % 2, cur, k + 1);
            } else {
                tile_end(ahead, last);
                fragment(0, (kt + 1) % STAGES, 0);
            }
            const int f = FRAG ? k % 2 : 0;
#pragma unroll
            for (int i = 0; i < TM; ++i)
#pragma unroll
                for (int j = 0; j < TN; ++j) acc[i][j] = fmaf(a[f][i], b[f][j], acc[i][j]);
        }
        if constexpr (!FRAG) tile_end(ahead, last);
    }
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < TN; j += 2) {
            const int64_t m = m0 + wm + (i / 4) * 4 * LM + (i % 4);
            const int64_t n = n0 + wn + (j / 4) * 4 * LN + (j % 4);
            if (m < M && n + 1 < N) kiln_store2(KERNEL_ARGS, blockIdx.y, bz, m, n, acc[i][j], acc[i][j + 1]);
            else if (m < M && n < N) kiln_store(KERNEL_ARGS, blockIdx.y, bz, m, n, acc[i][j]);
        }
}
