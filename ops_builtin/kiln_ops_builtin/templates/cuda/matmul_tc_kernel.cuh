// The kernel of kiln_ops_builtin.templates.matmul_tc (its docstring tells the algorithm): a
// block's BM x BN tile of out[b][m][n] = sum over k of a[m][k] * b(k, n) (blockIdx.x picks it,
// in groups of GROUP rows of tiles; blockIdx.y the split of K; blockIdx.z the batch b), each
// result handed to split_k's kiln_store / kiln_store2 (the core's epilogue hooks where K is not
// split). Shared memory is dynamic: STAGES k-tiles of A ([BM][BK]) then of B ([BN][BK], or
// [BK][BN] where B is row-major), rows' 16-byte chunks swizzled by kiln_swz.
//
// Needs, ahead of it, mma_sync.cuh, matmul_tc.cuh, the PTX wrappers CP_ASYNC, and the program's
// kiln_matmul_tc_program (matmul_tc.py renders it):
//   Tile                 kiln::matmul_tc::Tile<...> (the knobs)
//   Elem                 kiln::mma_sync::F16 or BF16
//   B_K_CONTIGUOUS       an enumerator: B is k-major ([N][K]), else row-major ([K][N])
//   a(ARGS, bz), b(...)  each operand of batch bz, a kiln::matmul_tc::Operand
// and split_k's M, N, K (run-time where symbolic), KT_SPLIT (k-tiles per blockIdx.y), its stores,
// PARAMS, ARGS and KERNEL_ARGS.
//
// The kernel's code is written here in the kernel itself, not in a function that it calls:
// NVRTC's optimizer meets a called function before it is inlined, and the machine code changes.
extern "C" __global__ void __launch_bounds__(kiln_matmul_tc_program::Tile::NT) kiln_matmul_tc(PARAMS) {
    using P = kiln_matmul_tc_program;
    using T = P::Tile;
    constexpr int NT = T::NT, BM = T::BM, BN = T::BN, BK = T::BK, WM = T::WM, WN = T::WN, STAGES = T::STAGES;
    constexpr int GROUP = T::GROUP;
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
    const kiln::matmul_tc::Operand a = P::a(ARGS, bz), b = P::b(ARGS, bz);
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
            kiln_cp_async16(as + r * BK + kiln_swz(r, c, BK / 8) * 8, a.p + (ok ? gm * a.x_stride + gk : 0),
                            ok ? 16 : 0);
        }
        if constexpr (P::B_K_CONTIGUOUS) {
#pragma unroll
            for (int i = 0; i < BN * (BK / 8) / NT; ++i) {
                const int idx = tid + i * NT, r = idx / (BK / 8), c = idx % (BK / 8);
                const int64_t gn = n0 + r, gk = (int64_t)(KT0 + kt) * BK + c * 8;
                const bool ok = gn < N && gk < K;
                kiln_cp_async16(bs + r * BK + kiln_swz(r, c, BK / 8) * 8, b.p + (ok ? gn * b.x_stride + gk : 0),
                                ok ? 16 : 0);
            }
        } else {
#pragma unroll
            for (int i = 0; i < BK * (BN / 8) / NT; ++i) {
                const int idx = tid + i * NT, r = idx / (BN / 8), c = idx % (BN / 8);
                const int64_t gk = (int64_t)(KT0 + kt) * BK + r, gn = n0 + c * 8;
                const bool ok = gk < K && gn < N;
                kiln_cp_async16(bs + r * BN + kiln_swz(r, c, BN / 8) * 8, b.p + (ok ? gk * b.k_stride + gn : 0),
                                ok ? 16 : 0);
            }
        }
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
        kiln::mma_sync::step<P::Elem, BK, BN, WM, WN, P::B_K_CONTIGUOUS>(acc, as, bs, wm, wn, lane);
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
                if (m < M && n + 1 < N) kiln_store2(KERNEL_ARGS, blockIdx.y, bz, m, n, acc[i][j][2 * h], acc[i][j][2 * h + 1]);
                else if (m < M && n < N) kiln_store(KERNEL_ARGS, blockIdx.y, bz, m, n, acc[i][j][2 * h]);
            }
}
