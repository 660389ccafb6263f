// The kernel of kiln_ops_builtin.templates.matmul_wgmma (its docstring tells the algorithm): a CTA
// of NT = 128 * WG threads computes one BM x BN tile (BM = 64 * WG * MI) of flat batch
// blockIdx.z over the k-tiles of split blockIdx.y, its operands copied by cp.async into STAGES
// 128-byte-swizzled K-major stages, AHEAD = STAGES - 2 k-tiles ahead, and multiplied by wgmma
// straight from shared memory; each result pair goes to split_k's kiln_store2 (kiln_store at an
// odd N's last column).
//
// Needs, ahead of it, the PTX wrappers CP_ASYNC and WGMMA, the wgmma product WGMMA(acc, da, db)
// (m64n{BN}k16, both operands K-major), split_k's stores and the program's
// kiln_matmul_wgmma_program (matmul_wgmma.py renders it):
//   NT, BM, BN, BK, MI, STAGES, AHEAD     the knobs and what derives from them
//   a_row(ARGS), b_row(ARGS)              the operands' row strides (elements from one m or n to the next)
//   a_batch(bz, ARGS), b_batch(bz, ARGS)  their offsets of flat batch bz
// and split_k's M, N, K, KT_SPLIT, PARAMS, ARGS and KERNEL_ARGS (sizes of the parameters where
// symbolic).
// k-tile kt of ROWS rows of a K-major operand (rows first.. of extent, stride elements apart,
// depth elements long) copied by NT threads into a 128-byte-swizzled stage, zeros past the edges
template <int ROWS, int NT, int BK>
__device__ __forceinline__ void kiln_wgmma_load_rows(uint16_t* stage, const uint16_t* src, int tid, int64_t first,
                                                     int64_t extent, int64_t stride, int kt, int64_t depth) {
#pragma unroll
    for (int i = 0; i < ROWS * 8 / NT; ++i) {
        const int idx = tid + i * NT, r = idx / 8, c = idx % 8;
        const int64_t g = first + r, gk = (int64_t)kt * BK + c * 8;
        const bool ok = g < extent && gk < depth;
        kiln_cp_async16(stage + r * BK + (c ^ (r & 7)) * 8, src + (ok ? g * stride + gk : 0), ok ? 16 : 0);
    }
}

extern "C" __global__ void __launch_bounds__(kiln_matmul_wgmma_program::NT, 1)
    kiln_matmul_wgmma(PARAMS, const uint16_t* __restrict__ a_source, const uint16_t* __restrict__ b_source) {
    using P = kiln_matmul_wgmma_program;
    constexpr int NT = P::NT, BM = P::BM, BN = P::BN, BK = P::BK, MI = P::MI, STAGES = P::STAGES, AHEAD = P::AHEAD;
    extern __shared__ unsigned char kiln_smem_raw[];
    uint16_t* As = (uint16_t*)(((uint64_t)kiln_smem_raw + 1023) & ~(uint64_t)1023);
    uint16_t* Bs = As + STAGES * BM * BK;
    const int tid = threadIdx.x, wg = tid / 128, t = tid % 128, w = t / 32, lane = t % 32;
    const int tiles_m = (M + BM - 1) / BM, tiles_n = (N + BN - 1) / BN;
    const int pid = blockIdx.x, group = pid / (8 * tiles_n);
    const int first_m = group * 8, rows = min(tiles_m - first_m, 8);
    const int tm = first_m + (pid % (8 * tiles_n)) % rows, tn = (pid % (8 * tiles_n)) / rows;
    const int64_t m0 = (int64_t)tm * BM, n0 = (int64_t)tn * BN, bz = blockIdx.z;
    const uint16_t* A = a_source + (P::a_batch(bz, KERNEL_ARGS));
    const uint16_t* B = b_source + (P::b_batch(bz, KERNEL_ARGS));
    float acc[MI][BN / 2];
#pragma unroll
    for (int i = 0; i < MI; ++i)
#pragma unroll
        for (int j = 0; j < BN / 2; ++j) acc[i][j] = 0.f;
    const int KT0 = blockIdx.y * KT_SPLIT, KT = min((int)((K + BK - 1) / BK) - KT0, KT_SPLIT);
    auto load = [&](int stage, int kt) {
        kiln_wgmma_load_rows<BM, NT, BK>(As + stage * BM * BK, A, tid, m0, M, P::a_row(KERNEL_ARGS), KT0 + kt, K);
        kiln_wgmma_load_rows<BN, NT, BK>(Bs + stage * BN * BK, B, tid, n0, N, P::b_row(KERNEL_ARGS), KT0 + kt, K);
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
