/* The convolution's kernel on conv.h, gemm.h and planes.h (kiln_ops_builtin.templates.conv_cpu):
   the planes filled once per call (or the input itself, IN_PLACE; but the last image, where
   LAST_COPIED), each tap's offset, then the GEMM; and the weight's panels laid out once
   (kiln_conv_prepare). */

static int64_t kiln_conv_prepare(TASK_PARAMS, const float* __restrict__ bpre, float* dst) {
    return kiln_pack_panels(TASK_ARGS, bpre, NULL, NULL, dst);
}

static void kiln_conv(TASK_PARAMS, const float* __restrict__ bpre) {
    enum { FIRST = LAST_COPIED ? IMAGES - 1 : 0, FILLED = IN_PLACE ? 0 : IMAGES - FIRST };    /* the images filled */
    float* filled = FILLED ? kiln_alloc(FILLED * PLANE) : NULL;
    int64_t* koffs = (int64_t*)malloc(K * sizeof(int64_t));
    for (int64_t k = 0; k < K; ++k) koffs[k] = kiln_koff(k);
    const int threads = (double)FILLED * PLANE > 65536.0 ? omp_get_max_threads() : 1;
#pragma omp parallel for collapse(2) schedule(static) num_threads(threads)
    for (int64_t b = 0; b < FILLED; ++b)
        for (int64_t c = 0; c < CIN; ++c) kiln_fill(TASK_ARGS, FIRST + b, c, filled + b * PLANE + c * PSH * PSW * HQ * WQ);
    for (int64_t b = 0; b < FILLED; ++b)
        for (int64_t e = INPUT_IMAGE; e < PLANE; ++e) filled[b * PLANE + e] = 0.f;
    kiln_gemm(TASK_ARGS, bpre, IN_PLACE ? (const float*)INPUT_PLANES : filled, koffs);
    free(koffs);
    free(filled);
}
