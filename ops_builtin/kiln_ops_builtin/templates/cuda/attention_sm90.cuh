// The kernel of kiln_ops_builtin.templates.attention_sm90 (its docstring tells the algorithm): a
// CTA owns BM = 64 * CW queries of one flat batch bh; its producer warpgroup copies the queries
// once and the key tiles' K and V into STAGES-deep rings (TMA, 128-byte swizzle), its CW consumer
// warpgroups (64 query rows each) compute S = Q K^T and O += P V on wgmma with
// attention_softmax.cuh's online softmax between them, and hand each normalized output pair to
// the epilogue hook kiln_epilogue2(ARGS, bh, i, d, v0, v1).
//
// Needs, ahead of it, attention_softmax.cuh (and what it needs), tma_batch.cuh, the PTX wrappers
// MBARRIER, TMA and WGMMA, the wgmma products WGMMA_QK(s, da, db, sd) (m64n{BN}k16, both operands
// K-major in shared memory; sd 0 overwrites s) and WGMMA_PV(o, p, db) (m64n{DP}k16, A in
// registers, B MN-major), and the program's kiln_attention_sm90_program (attention_sm90.py
// renders it): what attention_softmax.cuh reads, and
//   D, DP                    the head dim; as the tiles hold it (whole 64-column boxes)
//   BM, BN, CW, STAGES       queries a CTA, keys a tile, consumer warpgroups, slots of each ring
//   SWIZZLE_ATOM             the byte stride of 8 rows of a 128-byte-swizzled tile
//   PRODUCER_REGS, CONSUMER_REGS   the warpgroups' registers (setmaxnreg)
//   pack(lo, hi)             two floats as one register of two 16-bit elements
//   q_batch(ARGS), k_batch(ARGS), v_batch(ARGS)
//                            the operands' batch dims (tma_batch.cuh's kiln::tma::Batch each: the
//                            tensor maps' dims after columns and rows)
// and, besides the macros attention_softmax.cuh reads (PARAMS, ARGS, LQ, LK), M_BLOCKS (query
// blocks of a flat batch, of the parameters where symbolic).

namespace kiln::attention {

// The key tiles that rows first .. first + count - 1 (those before LQ) see.
template <typename P>
static __device__ __forceinline__ int key_tiles(int first, int count, PARAMS) {
    const int keys = P::CAUSAL ? min(LK, min(LQ, first + count)) : LK;
    return (keys + P::BN - 1) / P::BN;
}

}  // namespace kiln::attention

extern "C" __global__ void __launch_bounds__(128 * (kiln_attention_sm90_program::CW + 1), 1)
    kiln_attention_sm90(PARAMS, const __grid_constant__ CUtensorMap tmQ,
                        const __grid_constant__ CUtensorMap tmK, const __grid_constant__ CUtensorMap tmV) {
    using P = kiln_attention_sm90_program;
    constexpr int D = P::D, DP = P::DP, BM = P::BM, BN = P::BN, CW = P::CW, STAGES = P::STAGES;
    constexpr bool CAUSAL = P::CAUSAL;
    extern __shared__ unsigned char kiln_smem_raw[];
    uint16_t* Qs = (uint16_t*)(((uint64_t)kiln_smem_raw + 1023) & ~(uint64_t)1023);   // [DP / 64][BM][64]
    uint16_t* Ks = Qs + BM * DP;                      // STAGES x [DP / 64][BN][64], likewise V
    uint16_t* Vs = Ks + STAGES * BN * DP;
    uint64_t* q_full = (uint64_t*)(Vs + STAGES * BN * DP);
    uint64_t* full = q_full + 1;                      // [2][STAGES]: K's slots, then V's
    uint64_t* empty = full + 2 * STAGES;              // likewise
    const int tid = threadIdx.x, wg = tid / 128;
    const int64_t bh = blockIdx.x / M_BLOCKS;
    const int mb = CAUSAL ? M_BLOCKS - 1 - (int)(blockIdx.x % M_BLOCKS) : (int)(blockIdx.x % M_BLOCKS);
    const int m0 = mb * BM, tiles = kiln::attention::key_tiles<P>(m0, BM, ARGS);
    if (tid == 0) {
        kiln_bar_init(q_full, 1);
        for (int s = 0; s < 2 * STAGES; ++s) {
            kiln_bar_init(&full[s], 1);
            kiln_bar_init(&empty[s], CW * 128);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    if (wg == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" :: "n"((int)P::PRODUCER_REGS));
        if (tid == 0) {
            kiln_bar_expect(q_full, BM * DP * 2);
#pragma unroll
            for (int c = 0; c < DP / 64; ++c)
                kiln::tma::load(Qs + c * BM * 64, &tmQ, q_full, c * 64, m0, P::q_batch(ARGS), bh);
            for (int t = 0; t < tiles; ++t) {
                const int s = t % STAGES, phase = ((t / STAGES) & 1) ^ 1;
                kiln_bar_wait(&empty[s], phase);
                kiln_bar_expect(&full[s], BN * DP * 2);
#pragma unroll
                for (int c = 0; c < DP / 64; ++c)
                    kiln::tma::load(Ks + (s * DP / 64 + c) * BN * 64, &tmK, &full[s], c * 64, t * BN, P::k_batch(ARGS),
                                    bh);
                kiln_bar_wait(&empty[STAGES + s], phase);
                kiln_bar_expect(&full[STAGES + s], BN * DP * 2);
#pragma unroll
                for (int c = 0; c < DP / 64; ++c)
                    kiln::tma::load(Vs + (s * DP / 64 + c) * BN * 64, &tmV, &full[STAGES + s], c * 64, t * BN,
                                    P::v_batch(ARGS), bh);
            }
        }
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" :: "n"((int)P::CONSUMER_REGS));
    const int c = wg - 1, lane = tid % 32, rows = m0 + c * 64, row = rows + (tid % 128) / 32 * 16;
    const int mine = rows < LQ ? kiln::attention::key_tiles<P>(rows, 64, ARGS) : 0;   // the tiles its rows see
    const uint16_t* qs = Qs + c * 64 * 64;
    float o[DP / 2], s[BN / 2], mx[2] = {-INFINITY, -INFINITY}, sum[2] = {0.f, 0.f}, alpha[2];
    unsigned p[BN / 4];
#pragma unroll
    for (int e = 0; e < DP / 2; ++e) o[e] = 0.f;
    // tile t's K (x = 0) or V (x = 1): waiting for its copies, releasing its slot
    auto await = [&](int x, int t) { kiln_bar_wait(&full[x * STAGES + t % STAGES], (t / STAGES) & 1); };
    auto release = [&](int x, int t) { kiln_bar_arrive(&empty[x * STAGES + t % STAGES]); };
    // S = Q K^T of tile t, issued
    auto scores = [&](int t) {
        const uint16_t* ks = Ks + t % STAGES * BN * DP;
        kiln_wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < DP / 16; ++kk)
            WGMMA_QK(s, kiln_gdesc(qs + kk / 4 * BM * 64, 16, P::SWIZZLE_ATOM) + 2 * (kk % 4),
                     kiln_gdesc(ks + kk / 4 * BN * 64, 16, P::SWIZZLE_ATOM) + 2 * (kk % 4), kk);
        kiln_wgmma_commit();
    };
    // O += P V of tile t, issued
    auto values = [&](int t) {
        const uint16_t* vs = Vs + t % STAGES * BN * DP;
        kiln_wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk)
            WGMMA_PV(o, &p[4 * kk], kiln_gdesc(vs + kk * 16 * 64, BN * 128, P::SWIZZLE_ATOM));
        kiln_wgmma_commit();
    };
    // the online softmax of tile t's scores, edges masked where the tile crosses one
    auto softmax = [&](int t) {
        const int n0 = t * BN;
        if (n0 + BN > LK || (CAUSAL && n0 + BN - 1 > row))
            kiln::attention::softmax_step<P, true, BN / 8>(s, mx, sum, alpha, row, n0, bh, lane, ARGS);
        else
            kiln::attention::softmax_step<P, false, BN / 8>(s, mx, sum, alpha, row, n0, bh, lane, ARGS);
    };
    auto pack = [&]() {
#pragma unroll
        for (int e = 0; e < BN / 4; ++e) p[e] = P::pack(s[2 * e], s[2 * e + 1]);
    };
    if (mine > 0) {
        kiln_bar_wait(q_full, 0);
        await(0, 0);
        scores(0);
        kiln_wgmma_wait<0>();
        kiln_wgmma_keep<BN / 2>(s);
        release(0, 0);
        softmax(0);
        pack();
        for (int t = 1; t < mine; ++t) {
            await(0, t);
            scores(t);
            await(1, t - 1);
            values(t - 1);
            kiln_wgmma_wait<1>();
            kiln_wgmma_keep<BN / 2>(s);
            release(0, t);
            softmax(t);
            kiln_wgmma_keep<BN / 2>(s);               // the softmax runs before the wait, beside the P V product
            kiln_wgmma_wait<0>();
            kiln_wgmma_keep<DP / 2>(o);
            kiln_wgmma_keep<BN / 4>(p);
            release(1, t - 1);
            kiln::attention::rescale_rows<DP / 8>(o, alpha);
            pack();
        }
        await(1, mine - 1);
        values(mine - 1);
        kiln_wgmma_wait<0>();
        kiln_wgmma_keep<DP / 2>(o);
        release(1, mine - 1);
    }
    for (int t = mine; t < tiles; ++t) {          // tiles only the other consumers' rows see
        await(0, t);
        release(0, t);
        await(1, t);
        release(1, t);
    }
    if (mine > 0) kiln::attention::store_rows<D / 8>(o, sum, row, bh, lane, ARGS);
}
