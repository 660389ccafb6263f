// The online softmax of the fused attention kernels on tensor-core accumulator fragments in
// registers, shared by kiln_ops_builtin.templates.attention_flash (mma.sync), attention_decode
// (through attention_flash.cuh's tile step) and attention_sm90 (wgmma).
//
// A warp holds 16 rows of a tile as NC chunks of 8 columns, chunk nt at [nt * 4 + 2 * h + c]:
// row lane / 4 + 8 * h, column nt * 8 + (lane & 3) * 2 + c. That is the float32 accumulator of
// mma.sync.m16n8k16 and a warp's 16 rows of wgmma.m64nNk16's alike, so the same code runs the
// softmax on the scores S = Q K^T of both, and normalizes and stores the outputs O of both.
//
// Needs, ahead of it, attention.cuh, the PTX wrappers CVT_EX2 (kiln_ex2) and the hooks kiln_mask
// (with a mask) and kiln_epilogue2; reads the macros PARAMS, ARGS, LQ, LK (attention_match's
// Attention.device_defines) and, of the program P a kernel names (attention_softmax.py's
// `members` renders them):
//   CAUSAL, Mask, scale_log2()   Attention.device_operands'
//   RAW_MAX                      the row maximum is taken before scaling (a positive scale, no float mask)
//   query_i(r, ARGS), query_bh(bh, r, ARGS), query_ok(r, ARGS)
//                                tile row r of flat batch bh: its query, the query's flat batch,
//                                and whether it is a real query (ARGS: the sizes may be parameters)

namespace kiln::attention {

// One key tile's scores s (NC chunks, keys n0 ..) of the 16 tile rows from `row`: scaled into the
// log2 domain, masked (the mask hook; with Edge, keys past LK and, causal, after the query),
// exponentiated in place relative to the rows' new maxima mx, their sums updated. alpha[h]: the
// factor by which row h's earlier outputs must be rescaled. A row masked so far keeps maximum
// -inf and sum 0.
template <typename P, bool Edge, int NC>
static __device__ __forceinline__ void softmax_step(float* s, float (&mx)[2], float (&sum)[2], float (&alpha)[2],
                                                    int row, int n0, int64_t bh, int lane, PARAMS) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = row + (lane >> 2) + h * 8, i = P::query_i(r, ARGS);
        float top = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < NC; ++nt)
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                const int j = n0 + nt * 8 + (lane & 3) * 2 + c;
                float x = s[nt * 4 + 2 * h + c];                      // with RAW_MAX, scaled after the maximum
                if constexpr (!P::RAW_MAX) x = x * P::scale_log2();
                if constexpr (P::Mask::PRESENT)
                    if (P::query_ok(r, ARGS) && j < LK) P::Mask::apply(x, P::query_bh(bh, r, ARGS), i, j, ARGS);
                if (Edge && (j >= LK || (P::CAUSAL && j > i))) x = -INFINITY;
                s[nt * 4 + 2 * h + c] = x;
                top = fmaxf(top, x);
            }
        top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, 1));
        top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, 2));
        if constexpr (P::RAW_MAX) top *= P::scale_log2();
        const float now = fmaxf(mx[h], top);
        const float shift = now == -INFINITY ? 0.f : now;     // a row masked so far stays at sum 0
        alpha[h] = kiln_ex2(mx[h] - shift);
        mx[h] = now;
        float part = 0.f;
#pragma unroll
        for (int nt = 0; nt < NC; ++nt)
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                float p;
                if constexpr (P::RAW_MAX) p = kiln_ex2(fmaf(s[nt * 4 + 2 * h + c], P::scale_log2(), -shift));
                else p = kiln_ex2(s[nt * 4 + 2 * h + c] - shift);
                s[nt * 4 + 2 * h + c] = p;
                part += p;
            }
        sum[h] = sum[h] * alpha[h] + part;
    }
}

// The outputs o (NC chunks) of the tile's two rows of a lane times alpha[0] and alpha[1].
template <int NC>
static __device__ __forceinline__ void rescale_rows(float* o, const float (&alpha)[2]) {
#pragma unroll
    for (int nt = 0; nt < NC; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[nt * 4 + e] *= alpha[e / 2];
}

// A row's total over the four lanes of its quad.
static __device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// The outputs o (the first NC chunks) of the 16 tile rows from `row` of flat batch bh, divided
// by their rows' sums, through the epilogue hook; rows from LQ on are skipped, and a row whose
// sum is 0 (every key masked) gets zeros.
template <int NC>
static __device__ __forceinline__ void store_rows(const float* o, const float (&sum)[2], int row, int64_t bh, int lane,
                                                  PARAMS) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const float total = quad_sum(sum[h]);
        const int64_t i = row + (lane >> 2) + h * 8;
        if (i >= LQ) continue;
        const float inv = total == 0.f ? 0.f : 1.f / total;
#pragma unroll
        for (int nt = 0; nt < NC; ++nt)
            kiln_epilogue2(ARGS, bh, i, nt * 8 + (lane & 3) * 2, o[nt * 4 + 2 * h] * inv, o[nt * 4 + 2 * h + 1] * inv);
    }
}

}  // namespace kiln::attention
