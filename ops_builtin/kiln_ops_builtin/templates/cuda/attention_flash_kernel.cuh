// The kernel of kiln_ops_builtin.templates.attention_flash (its docstring tells the algorithm): a
// CTA of NT threads owns BM queries of one flat batch bh (NT / 32 warps of MT * 16 rows) and one
// share sp of the keys' tiles, walks them BN keys at a time through two shared-memory stages of K
// and V, and hands each normalized output pair to the epilogue hook kiln_epilogue2(ARGS, bh, i,
// d, v0, v1), or, with SPLIT > 1, its share's partial results to kiln_attention_combine
// (attention_combine.cuh).
//
// Needs, ahead of it, attention_flash.cuh (and what it needs) and the program's
// kiln_attention_flash_program (attention_flash.py renders it): what attention_flash.cuh reads,
// and BM, SPLIT (queries a CTA, shares of the keys) and q, k, v(ARGS, bh) (Attention.
// device_operands'); the macros Q_RS (as K_RS), KERNEL_PARAMS (PARAMS, then with SPLIT > 1 the
// partial results' temporaries), PART and STATS (those temporaries: [SPLIT][BATCH][LQ][D] values,
// [SPLIT][BATCH][LQ][2] maxima and sums; null pointers without a split, so that the branch that
// writes them compiles, discarded), and the sizes BATCH (flat batches), M_BLOCKS (query blocks of
// a flat batch) and TILES_PER_SPLIT (key tiles a share), of the parameters where symbolic.
extern "C" __global__ void __launch_bounds__(kiln_attention_flash_program::NT)
    kiln_attention_flash(KERNEL_PARAMS) {
    using P = kiln_attention_flash_program;
    constexpr int NT = P::NT, BM = P::BM, BN = P::BN, D = P::D, LDS = P::LDS, MT = P::MT, SPLIT = P::SPLIT;
    constexpr bool CAUSAL = P::CAUSAL;
    extern __shared__ __align__(128) unsigned char kiln_smem[];
    uint16_t* Qs = (uint16_t*)kiln_smem;
    uint16_t* Ks = Qs + BM * LDS;
    uint16_t* Vs = Ks + 2 * BN * LDS;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int sp = (int)(blockIdx.x % SPLIT);                 // the CTA's share of the keys
    const int64_t rest = blockIdx.x / SPLIT, bh = rest / M_BLOCKS;
    const int mb = CAUSAL ? M_BLOCKS - 1 - (int)(rest % M_BLOCKS) : (int)(rest % M_BLOCKS);
    const int m0 = mb * BM, row0 = m0 + warp * MT * 16;
    const uint16_t* Q = P::q(ARGS, bh);
    const uint16_t* K = P::k(ARGS, bh);
    const uint16_t* V = P::v(ARGS, bh);
    const int keys = CAUSAL ? min(LK, m0 + BM) : LK;
    const int tiles = (keys + BN - 1) / BN;
    const int t0 = min(tiles, sp * TILES_PER_SPLIT), t1 = min(tiles, t0 + TILES_PER_SPLIT);
    if (m0 + BM <= LQ) kiln::attention::load_rows<P, BM, false>(Qs, Q + m0 * Q_RS, Q_RS, BM, tid);
    else kiln::attention::load_rows<P, BM, true>(Qs, Q + m0 * Q_RS, Q_RS, LQ - m0, tid);
    auto load_keys = [&](int stage, int n0) {
        kiln::attention::load_keys<P, BN>(Ks + stage * BN * LDS, Vs + stage * BN * LDS, K, V, n0, tid, ARGS);
    };
    if (t0 < t1) load_keys(0, t0 * BN);
    kiln_cp_async_commit();
    float o[MT][D / 2], mx[MT][2], sum[MT][2];
    kiln::attention::start_rows<P>(o, mx, sum);
    const uint16_t* qs = Qs + warp * MT * 16 * LDS;
    for (int t = t0; t < t1; ++t) {
        if (t + 1 < t1) load_keys((t + 1 - t0) & 1, (t + 1) * BN);
        kiln_cp_async_commit();
        kiln_cp_async_wait<1>();
        __syncthreads();
        const int n0 = t * BN;
        const uint16_t* ks = Ks + ((t - t0) & 1) * BN * LDS;
        const uint16_t* vs = Vs + ((t - t0) & 1) * BN * LDS;
        // a warp skips tiles whose keys all follow its rows, and rows all past LQ (decoding)
        if (row0 < LQ && (!CAUSAL || n0 <= row0 + MT * 16 - 1)) {
            if (n0 + BN > LK || (CAUSAL && n0 + BN - 1 > row0))
                kiln::attention::attend<P, true>(o, mx, sum, qs, ks, vs, row0, n0, bh, lane, ARGS);
            else
                kiln::attention::attend<P, false>(o, mx, sum, qs, ks, vs, row0, n0, bh, lane, ARGS);
        }
        __syncthreads();
    }
    kiln_cp_async_wait<0>();        // an empty share's query copies
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        if constexpr (SPLIT > 1) {
            // partial results: O unnormalized, relative to the row maximum, with maximum and sum
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const float total = kiln::attention::quad_sum(sum[mt][h]);
                const int64_t i = row0 + mt * 16 + (lane >> 2) + h * 8;
                if (i >= LQ) continue;
                const int64_t row = ((int64_t)sp * BATCH + bh) * LQ + i;
#pragma unroll
                for (int dt = 0; dt < D / 8; ++dt)
                    *(float2*)&PART[row * D + dt * 8 + (lane & 3) * 2] =
                        make_float2(o[mt][dt * 4 + 2 * h], o[mt][dt * 4 + 2 * h + 1]);
                if ((lane & 3) == 0) *(float2*)&STATS[row * 2] = make_float2(mx[mt][h], total);
            }
        } else {
            kiln::attention::store_rows<D / 8>(o[mt], sum[mt], row0 + mt * 16, bh, lane, ARGS);
        }
    }
}
