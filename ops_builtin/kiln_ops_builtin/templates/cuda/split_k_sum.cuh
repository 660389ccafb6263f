// split_k's second kernel where K is split: out[b, m, n] = epilogue(sum over s of
// kiln_ws[s][b][m][n]), the SPLIT partials of each element added in a fixed order (deterministic,
// no atomics), a thread per two neighbouring columns, in a grid-stride loop.
//
// Needs, ahead of it, split_k.cuh's needs: kiln_split_k_program's SPLIT, BATCH, M, N, the core's
// epilogue hooks, PARAMS (ending with kiln_ws) and ARGS (the hooks' arguments).
extern "C" __global__ void __launch_bounds__(256) kiln_split_k_sum(PARAMS) {
    using P = kiln_split_k_program;
    const int64_t pairs = (N + 1) / 2, total = (int64_t)BATCH * M * pairs, slice = (int64_t)BATCH * M * N;
    for (int64_t i = (int64_t)blockIdx.x * 256 + threadIdx.x; i < total; i += (int64_t)gridDim.x * 256) {
        // one batch needs no division by M, a 64-bit one where M is a run-time size
        const int64_t row = i / pairs, n = i % pairs * 2, b = BATCH == 1 ? 0 : row / M, m = BATCH == 1 ? row : row % M;
        const float* p = kiln_ws + row * N + n;
        float v0 = 0.f, v1 = 0.f;
        if (n + 1 < N) {
#pragma unroll 4
            for (int s = 0; s < P::SPLIT; ++s) {
                v0 += p[s * slice];
                v1 += p[s * slice + 1];
            }
            kiln_epilogue2(ARGS, b, m, n, v0, v1);
        } else {
#pragma unroll 4
            for (int s = 0; s < P::SPLIT; ++s) v0 += p[s * slice];
            kiln_epilogue(ARGS, b, m, n, v0);
        }
    }
}
