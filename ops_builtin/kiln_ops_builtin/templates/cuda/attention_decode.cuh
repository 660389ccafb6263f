// The kernel of kiln_ops_builtin.templates.attention_decode (its docstring tells the algorithm):
// a CTA of NT threads owns one key/value head bkv, one block of ROW_BLOCK tile rows (tile row r
// is query r % LQ of query head bkv * GROUP + r / LQ) and one share sp of the keys' tiles. Its
// warps are WR row warps (MT * 16 rows each) times WK key warps; it walks the share KT = WK * BN
// keys at a time through two shared-memory stages of K and V, key warp wk taking keys wk * BN ..
// of each tile with attention_flash.cuh's tile step. The key warps then merge their rows through
// shared memory (merge_shares) and hand each normalized output pair to the epilogue hook
// kiln_epilogue2(ARGS, bh, i, d, v0, v1), or, with SPLIT > 1, the share's partial results to
// kiln_attention_combine (attention_combine.cuh).
//
// Needs, ahead of it, attention_flash.cuh (and what it needs) and the program's
// kiln_attention_decode_program (attention_decode.py renders it with attention_flash.py's
// `program`): what attention_flash.cuh reads, and SPLIT (shares of the keys), WR, WK, KT,
// ROW_BLOCK, GROUP (query heads a key/value head) and k, v(ARGS, bh) (Attention.
// device_operands'); the macros Q_RS (as K_RS), KERNEL_PARAMS, PART and STATS (as
// attention_flash_kernel.cuh reads them), the sizes BATCH (flat query batches), ROW_BLOCKS (row
// blocks of a key/value head) and TILES_PER_SPLIT (key tiles a share), of the parameters where
// symbolic, and Q_PARAM and Q_BASE: q's parameter and the offset of row 0 of flat batch qbh, an
// expression of the variable qbh (the program's q(ARGS, qbh) would serve, but NVRTC then
// computes the offset of the rows past the queries too, which copy nothing).
extern "C" __global__ void __launch_bounds__(kiln_attention_decode_program::NT)
    kiln_attention_decode(KERNEL_PARAMS) {
    using P = kiln_attention_decode_program;
    constexpr int NT = P::NT, BN = P::BN, D = P::D, LDS = P::LDS, MT = P::MT, SPLIT = P::SPLIT;
    constexpr int WR = P::WR, WK = P::WK, KT = P::KT, ROW_BLOCK = P::ROW_BLOCK;
    constexpr bool CAUSAL = P::CAUSAL;
    extern __shared__ __align__(128) unsigned char kiln_smem[];
    uint16_t* Qs = (uint16_t*)kiln_smem;
    uint16_t* Ks = Qs + ROW_BLOCK * LDS;
    uint16_t* Vs = Ks + 2 * KT * LDS;
    float* shares = (float*)Ks;                                 // once the keys are done: per key warp,
    float* share_stats = shares + WK * ROW_BLOCK * D;           // [ROW_BLOCK][D] values, [ROW_BLOCK][2] max, sum
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wr = warp % WR, wk = warp / WR;
    const int sp = (int)(blockIdx.x % SPLIT);                  // the CTA's share of the keys
    const int64_t rest = blockIdx.x / SPLIT, bkv = rest / ROW_BLOCKS;
    const int r0 = (int)(rest % ROW_BLOCKS) * ROW_BLOCK;
    const int64_t kbh = bkv * P::GROUP;                         // the first query head of key/value head bkv
    const uint16_t* K = P::k(ARGS, kbh);
    const uint16_t* V = P::v(ARGS, kbh);
    const int keys = CAUSAL ? min(LK, LQ) : LK;
    const int tiles = (keys + KT - 1) / KT;
    const int t0 = min(tiles, sp * TILES_PER_SPLIT), t1 = min(tiles, t0 + TILES_PER_SPLIT);
    for (int idx = tid; idx < ROW_BLOCK * (D / 8); idx += NT) {
        const int row = idx / (D / 8), c = idx % (D / 8), r = r0 + row;
        const int64_t qbh = kbh + r / LQ;
        const bool ok = r < P::GROUP * LQ;
        const uint16_t* src = (const uint16_t*)Q_PARAM + (ok ? (Q_BASE) + (r % LQ) * Q_RS + c * 8 : 0);
        kiln_cp_async16(Qs + row * LDS + c * 8, src, ok ? 16 : 0);
    }
    auto load_keys = [&](int stage, int n0) {
        kiln::attention::load_keys<P, KT>(Ks + stage * KT * LDS, Vs + stage * KT * LDS, K, V, n0, tid, ARGS);
    };
    if (t0 < t1) load_keys(0, t0 * KT);
    kiln_cp_async_commit();
    float o[MT][D / 2], mx[MT][2], sum[MT][2];
    kiln::attention::start_rows<P>(o, mx, sum);
    const int row0 = r0 + wr * MT * 16;
    const uint16_t* qs = Qs + wr * MT * 16 * LDS;
    for (int t = t0; t < t1; ++t) {
        if (t + 1 < t1) load_keys((t + 1 - t0) & 1, (t + 1) * KT);
        kiln_cp_async_commit();
        kiln_cp_async_wait<1>();
        __syncthreads();
        const int n0 = t * KT + wk * BN;
        const uint16_t* ks = Ks + (((t - t0) & 1) * KT + wk * BN) * LDS;
        const uint16_t* vs = Vs + (((t - t0) & 1) * KT + wk * BN) * LDS;
        if (row0 < P::GROUP * LQ && n0 < keys) {
            if (CAUSAL || n0 + BN > LK)
                kiln::attention::attend<P, true>(o, mx, sum, qs, ks, vs, row0, n0, bkv, lane, ARGS);
            else
                kiln::attention::attend<P, false>(o, mx, sum, qs, ks, vs, row0, n0, bkv, lane, ARGS);
        }
        __syncthreads();
    }
    kiln_cp_async_wait<0>();        // an empty share's query copies
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float total = kiln::attention::quad_sum(sum[mt][h]);
            const int row = wk * ROW_BLOCK + wr * MT * 16 + mt * 16 + (lane >> 2) + h * 8;
#pragma unroll
            for (int dt = 0; dt < D / 8; ++dt)
                *(float2*)&shares[row * D + dt * 8 + (lane & 3) * 2] =
                    make_float2(o[mt][dt * 4 + 2 * h], o[mt][dt * 4 + 2 * h + 1]);
            if ((lane & 3) == 0) *(float2*)&share_stats[row * 2] = make_float2(mx[mt][h], total);
        }
    __syncthreads();
    for (int idx = tid; idx < ROW_BLOCK * (D / 2); idx += NT) {
        const int row = idx / (D / 2), n = idx % (D / 2) * 2, r = r0 + row;
        if (r >= P::GROUP * LQ) break;
        float top, total;
        const float2 v = kiln::attention::merge_shares(WK, share_stats + row * 2, ROW_BLOCK * 2, shares + row * D + n,
                                                      ROW_BLOCK * D, top, total);
        const int64_t qbh = kbh + r / LQ, i = r % LQ;
        if constexpr (SPLIT > 1) {
            // the share's partial result: unnormalized, relative to the row maximum, with maximum and sum
            const int64_t out = ((int64_t)sp * BATCH + qbh) * LQ + i;
            *(float2*)&PART[out * D + n] = v;
            if (n == 0) *(float2*)&STATS[out * 2] = make_float2(top, total);
        } else {
            const float inv = total == 0.f ? 0.f : 1.f / total;
            kiln_epilogue2(ARGS, qbh, i, n, v.x * inv, v.y * inv);
        }
    }
}
