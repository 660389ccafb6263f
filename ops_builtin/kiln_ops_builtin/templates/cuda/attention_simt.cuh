// The float32 attention kernel of kiln_ops_builtin.templates.attention_simt (its docstring tells
// the algorithm): a CTA of NW warps owns BM = NW * R queries of one flat batch bh, walks the keys
// BN = 32 at a time (one a lane) and hands each normalized output pair to the epilogue hook
// kiln_epilogue2(ARGS, bh, i, d, v0, v1).
//
// Needs, ahead of it, attention.cuh and the program's kiln_attention_simt_program
// (attention_simt.py renders it):
//   NW, R, D              the knobs (warps, query rows a warp) and the head dim, as enumerators
//   CAUSAL, Mask          causality; the mask's kind (kiln::attention::NoMask, BoolMask, FloatMask)
//   scale_log2()          the softmax scale in the log2 domain
//   q, k, v               (ARGS, bh) -> const float*: row 0 of flat batch bh
//   q_rs, k_rs, v_rs      (ARGS) -> int64_t: elements from one row to the next
// and the macros PARAMS, ARGS (the kernel's parameters and their names), and LQ, LK, M_BLOCKS
// (queries, keys, query blocks per flat batch: ints, of the parameters where symbolic; macros,
// so that a size that is a number is a literal where it is read, as the optimizer best uses it).

extern "C" __global__ void __launch_bounds__(kiln_attention_simt_program::NW * 32) kiln_attention_simt(PARAMS) {
    using P = kiln_attention_simt_program;
    constexpr int NW = P::NW, R = P::R, D = P::D, BM = NW * R;
    constexpr int BN = 32;                          // keys a tile: one a lane
    constexpr int DP = (D + 63) / 64 * 64;          // V's row in shared memory: whole 64-column blocks, two a lane
    constexpr bool CAUSAL = P::CAUSAL;
    extern __shared__ __align__(16) float kiln_smem_f[];
    float* Qs = kiln_smem_f;                        // [BM][D]
    float* Ks = Qs + BM * D;                        // [BN][D + 1]
    float* Vs = Ks + BN * (D + 1);                  // [BN][DP]
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int64_t bh = blockIdx.x / M_BLOCKS;
    const int mb = CAUSAL ? M_BLOCKS - 1 - (int)(blockIdx.x % M_BLOCKS) : (int)(blockIdx.x % M_BLOCKS);
    const int m0 = mb * BM;
    const float* Q = P::q(ARGS, bh);
    const float* K = P::k(ARGS, bh);
    const float* V = P::v(ARGS, bh);
    for (int e = tid; e < BM * D; e += NW * 32) {
        const int r = e / D, c = e % D;
        Qs[e] = m0 + r < LQ ? Q[(int64_t)(m0 + r) * P::q_rs(ARGS) + c] : 0.f;
    }
    float o[R][DP / 64][2], mx[R], sum[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        mx[r] = -INFINITY;
        sum[r] = 0.f;
#pragma unroll
        for (int c = 0; c < DP / 64; ++c) o[r][c][0] = o[r][c][1] = 0.f;
    }
    const int keys = CAUSAL ? min(LK, m0 + BM) : LK;
    for (int n0 = 0; n0 < keys; n0 += BN) {
        __syncthreads();                            // the previous tile's readers are done
        for (int e = tid; e < BN * DP; e += NW * 32) {      // keys past LK, and V's columns past D: zeros
            const int j = e / DP, c = e % DP;
            const bool in = n0 + j < LK && c < D;
            if (c < D) Ks[j * (D + 1) + c] = in ? K[(int64_t)(n0 + j) * P::k_rs(ARGS) + c] : 0.f;
            Vs[j * DP + c] = in ? V[(int64_t)(n0 + j) * P::v_rs(ARGS) + c] : 0.f;
        }
        __syncthreads();
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const int row = warp * R + r, i = m0 + row, j = n0 + lane;
            if (i >= LQ) continue;
            float s = 0.f;
#pragma unroll 8
            for (int c = 0; c < D; ++c) s = fmaf(Qs[row * D + c], Ks[lane * (D + 1) + c], s);
            float x = s * P::scale_log2();
            if constexpr (P::Mask::PRESENT)
                if (j < LK) P::Mask::apply(x, bh, i, j, ARGS);
            if (j >= LK || (CAUSAL && j > i)) x = -INFINITY;
            float top = x;
#pragma unroll
            for (int m = 16; m > 0; m >>= 1) top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, m));
            const float now = fmaxf(mx[r], top);
            const float shift = now == -INFINITY ? 0.f : now;     // a row masked so far stays at sum 0
            const float alpha = exp2f(mx[r] - shift);
            const float p = exp2f(x - shift);
            float part = p;
#pragma unroll
            for (int m = 16; m > 0; m >>= 1) part += __shfl_xor_sync(0xffffffffu, part, m);
            mx[r] = now;
            sum[r] = sum[r] * alpha + part;
#pragma unroll
            for (int c = 0; c < DP / 64; ++c) {
                o[r][c][0] *= alpha;
                o[r][c][1] *= alpha;
            }
#pragma unroll 8
            for (int k = 0; k < BN; ++k) {
                const float pk = __shfl_sync(0xffffffffu, p, k);
#pragma unroll
                for (int c = 0; c < DP / 64; ++c) {
                    const float2 v = *(const float2*)&Vs[k * DP + c * 64 + 2 * lane];
                    o[r][c][0] = fmaf(pk, v.x, o[r][c][0]);
                    o[r][c][1] = fmaf(pk, v.y, o[r][c][1]);
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const int64_t i = m0 + warp * R + r;
        if (i >= LQ) continue;
        const float inv = sum[r] == 0.f ? 0.f : 1.f / sum[r];
#pragma unroll
        for (int c = 0; c < DP / 64; ++c) {
            const int d = c * 64 + 2 * lane;
            if (d < D) kiln_epilogue2(ARGS, bh, i, d, o[r][c][0] * inv, o[r][c][1] * inv);
        }
    }
}
