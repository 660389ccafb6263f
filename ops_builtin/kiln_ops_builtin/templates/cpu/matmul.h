/* The plain GEMM's kernel (kiln_ops_builtin.templates.gemm_cpu): kiln_main runs gemm.h's blocked
   kernel, or, with at most SMALL_M rows, one of three that pack nothing.

   The problem and knobs are gemm.h's; needs gemm.h and the hooks (kiln_a, kiln_b_row,
   kiln_b_col, kiln_epilogue_row) ahead of it. */

enum {
    SMALL_M = 4,    /* the most rows of the kernels that pack nothing */
    CHUNK = 512,    /* their columns per item of work */
};

/* Few rows (M <= SMALL_M: depthwise convolutions, vector-matrix products): no packing; each
   chunk of a B row, made once per k, is scaled into the M accumulator rows. */
static void kiln_few_rows(PARAMS, int threads) {
    const int64_t chunks = KILN_PANELS(N, CHUNK);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t u = 0; u < BATCH * chunks; ++u) {
        const int64_t b = u / chunks, n0 = u % chunks * CHUNK, count = KILN_MIN(CHUNK, N - n0);
        float acc[M][CHUNK] __attribute__((aligned(64)));
        float row[CHUNK] __attribute__((aligned(64)));
        for (int64_t m = 0; m < M; ++m)
            for (int64_t j = 0; j < CHUNK; ++j) acc[m][j] = 0.f;
        for (int64_t k = 0; k < K; ++k) {
            kiln_b_row(ARGS, b, k, n0, count, row);
            for (int64_t m = 0; m < M; ++m) {
                const float a = kiln_a(ARGS, b, m, k);
                for (int64_t j = 0; j < count; ++j) acc[m][j] += a * row[j];
            }
        }
        for (int64_t m = 0; m < M; ++m) kiln_epilogue_row(ARGS, b, m, n0, count, acc[m]);
    }
}

/* Few rows with B read along k (vector-matrix products with a linear layer's weight): dot
   products of A's rows with B's columns, each column copied once into a contiguous buffer. */
static void kiln_few_rows_by_k(PARAMS, int threads) {
    const int64_t chunks = KILN_PANELS(N, CHUNK);
#pragma omp parallel num_threads(threads)
    {
        float* arows = kiln_alloc(M * K);
        float* col = kiln_alloc(K);
        int64_t loaded = -1;
#pragma omp for schedule(static)
        for (int64_t u = 0; u < BATCH * chunks; ++u) {
            const int64_t b = u / chunks, n0 = u % chunks * CHUNK, count = KILN_MIN(CHUNK, N - n0);
            float acc[M][CHUNK] __attribute__((aligned(64)));
            if (b != loaded) {
                for (int64_t m = 0; m < M; ++m)
                    for (int64_t k = 0; k < K; ++k) arows[m * K + k] = kiln_a(ARGS, b, m, k);
                loaded = b;
            }
            for (int64_t j = 0; j < count; ++j) {
                kiln_b_col(ARGS, b, n0 + j, 0, K, col, 1);
                for (int64_t m = 0; m < M; ++m) {
                    const float* a = arows + m * K;
                    kiln_vf sum = (kiln_vf){0};
                    int64_t k = 0;
                    for (; k + VW <= K; k += VW) sum += *(const kiln_vfu*)(a + k) * *(const kiln_vfu*)(col + k);
                    float total = 0.f;
                    for (int e = 0; e < VW; ++e) total += sum[e];
                    for (; k < K; ++k) total += a[k] * col[k];
                    acc[m][j] = total;
                }
            }
            for (int64_t m = 0; m < M; ++m) kiln_epilogue_row(ARGS, b, m, n0, count, acc[m]);
        }
        free(col);
        free(arows);
    }
}

/* Few rows with B laid out once (bpre): each panel streamed once, A's rows (gathered once per
   batch) broadcast into the panel's NV vectors per row. */
static void kiln_few_rows_panels(PARAMS, int threads) {
    const int64_t panels = KILN_PANELS(N, NR);
#pragma omp parallel num_threads(threads)
    {
        float* arows = kiln_alloc(M * K);
        int64_t loaded = -1;
#pragma omp for schedule(static)
        for (int64_t u = 0; u < BATCH * panels; ++u) {
            const int64_t b = u / panels, n0 = u % panels * NR;
            const float* __restrict__ panel = bpre + n0 * K;
            kiln_vf acc[SMALL_M][NV];
            if (b != loaded) {
                for (int64_t m = 0; m < M; ++m)
                    for (int64_t k = 0; k < K; ++k) arows[m * K + k] = kiln_a(ARGS, b, m, k);
                loaded = b;
            }
            for (int64_t m = 0; m < SMALL_M; ++m)
                for (int j = 0; j < NV; ++j) acc[m][j] = (kiln_vf){0};
            for (int64_t k = 0; k < K; ++k)
                for (int64_t m = 0; m < M; ++m) {
                    const float a = arows[m * K + k];
#pragma GCC unroll 4
                    for (int j = 0; j < NV; ++j) acc[m][j] += a * *(const kiln_vfu*)(panel + k * NR + j * VW);
                }
            for (int64_t m = 0; m < M; ++m) {
                float row[NR] __attribute__((aligned(64)));
                for (int j = 0; j < NV; ++j) *(kiln_vf*)(row + j * VW) = acc[m][j];
                kiln_epilogue_row(ARGS, b, m, n0, KILN_MIN(NR, N - n0), row);
            }
        }
        free(arows);
    }
}

static void kiln_main(PARAMS) {
    if (M <= SMALL_M) {
        const int threads = (double)BATCH * M * N * K > 65536.0 ? omp_get_max_threads() : 1;
        if (bpre) kiln_few_rows_panels(ARGS, threads);
        else if (B_BY_K) kiln_few_rows_by_k(ARGS, threads);
        else kiln_few_rows(ARGS, threads);
        return;
    }
    kiln_gemm(ARGS);
}
