/* The convolution's kernel on conv.h, gemm.h and planes.h (kiln_ops_builtin.templates.conv_cpu):
   the planes filled once per call, each tap's offset, then the GEMM; and the weight's panels laid
   out once (kiln_conv_prepare). */

static int64_t kiln_conv_prepare(TASK_PARAMS, const float* __restrict__ bpre, float* dst) {
    return kiln_pack_panels(TASK_ARGS, bpre, NULL, NULL, dst);
}

static void kiln_conv(TASK_PARAMS, const float* __restrict__ bpre) {
    float* planes = kiln_alloc(IMAGES * PLANE);
    int64_t* koffs = (int64_t*)malloc(K * sizeof(int64_t));
    for (int64_t k = 0; k < K; ++k) koffs[k] = kiln_koff(k);
    const int threads = (double)IMAGES * PLANE > 65536.0 ? omp_get_max_threads() : 1;
#pragma omp parallel for collapse(2) schedule(static) num_threads(threads)
    for (int64_t b = 0; b < IMAGES; ++b)
        for (int64_t c = 0; c < CIN; ++c) kiln_fill(TASK_ARGS, b, c, planes + b * PLANE + c * SH * SW * HQ * WQ);
    for (int64_t b = 0; b < IMAGES; ++b)
        for (int64_t e = CIN * SH * SW * HQ * WQ; e < PLANE; ++e) planes[b * PLANE + e] = 0.f;
    kiln_gemm(TASK_ARGS, bpre, planes, koffs);
    free(koffs);
    free(planes);
}
