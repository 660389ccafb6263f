// The merge of split-KV attention's partial results (kiln_ops_builtin.templates.attention_flash's
// split_kv): out[bh, i, n..n+1] from the SPLIT partial results of row (bh, i), rescaled to their
// common maximum and normalized, through the epilogue hook; zeros where no share saw a key.
//
// Needs, ahead of it, attention_flash.cuh (merge_shares) and what it needs, and the program's
// kiln_attention_combine_program (split_kv renders it): SPLIT and D as enumerators; reads the
// macros PARAMS, ARGS, LQ and BATCH. Its parameters are PARAMS, then the temporaries: part
// ([SPLIT][BATCH][LQ][D] values, relative to their row's maximum) and stats ([SPLIT][BATCH][LQ][2]
// maxima and sums).
extern "C" __global__ void __launch_bounds__(256)
    kiln_attention_combine(PARAMS, float* __restrict__ part, float* __restrict__ stats) {
    using P = kiln_attention_combine_program;
    constexpr int D = P::D;
    const int64_t rows = (int64_t)BATCH * LQ, items = rows * (D / 2);
    for (int64_t idx = (int64_t)blockIdx.x * 256 + threadIdx.x; idx < items; idx += (int64_t)gridDim.x * 256) {
        const int64_t row = idx / (D / 2), n = idx % (D / 2) * 2;
        float top, l;
        const float2 o = kiln::attention::merge_shares(P::SPLIT, stats + row * 2, rows * 2, part + row * D + n,
                                                       rows * D, top, l);
        const float inv = l == 0.f ? 0.f : 1.f / l;
        kiln_epilogue2(ARGS, row / LQ, row % LQ, n, o.x * inv, o.y * inv);
    }
}
