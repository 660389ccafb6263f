/* Depthwise conv2d, or a max-pool, vectorized along the output's rows
   (kiln_ops_builtin.templates.conv_depthwise_cpu tells the algorithm): each (batch, channel)'s
   phase planes (planes.h), then blocks of up to DW_VECS vectors of an output row, a broadcast
   weight times unaligned loads per tap, staged DW_ROWS output rows at a time, which go through
   the epilogue hook as one run (a row at a time, MobileNetV2's rows of 7 and 14 left the hook's
   scalar code most of their pixels).

   Compile-time knobs, macros of the rendered program: DW_VECS (the block's vectors, fewer where
   the row is shorter), DW_MAX (0: the window's weighted sum, its weights from kiln_b_col; 1:
   its max, pool_cpu's). The problem is conv.h's; PARAMS is the task's buffers. Needs simd.h,
   common.h, planes.h and the hooks ahead of it. */

enum {
    DW_BLOCK = DW_VECS < (OW + VW - 1) / VW ? DW_VECS : (OW + VW - 1) / VW,   /* vectors of a block */
    DW_COLS = DW_BLOCK * VW,
    DW_STAGE = 4096,                                      /* floats of output rows staged, at most (a row at least) */
    DW_ROWS = DW_STAGE / OW < 1 ? 1 : DW_STAGE / OW < OH ? DW_STAGE / OW : OH,   /* rows a stage holds */
};

/* the window's reduction starts from this */
static inline kiln_vf kiln_dw_init(void) { return DW_MAX ? (kiln_vf){0} - INFINITY : (kiln_vf){0}; }

void kiln_kernel(TASK_PARAMS) {
    const int threads = (double)BATCH * CIN * OH * OW * KH * KW > 65536.0 ? omp_get_max_threads() : 1;
#pragma omp parallel num_threads(threads)
    {
        float* planes = kiln_alloc(PLANE);
        /* a block's vectors are stored whole: the lanes past a row's end are the next row's
           first, which its own blocks overwrite later, or the slack past the last row */
        float* __restrict__ stage = kiln_alloc(DW_ROWS * OW + DW_COLS);
        for (int64_t e = PSH * PSW * HQ * WQ; e < PLANE; ++e) planes[e] = 0.f;
#pragma omp for schedule(static)
        for (int64_t u = 0; u < BATCH * CIN; ++u) {
            const int64_t b = u / CIN, c = u % CIN;
            float w[KH * KW];
#if DW_MAX
            for (int64_t e = 0; e < KH * KW; ++e) w[e] = 0.f;
#else
            kiln_b_col(ARGS, b, c, 0, KH * KW, w, 1);
#endif
            kiln_fill(TASK_ARGS, b, c, planes);
            for (int64_t oh0 = 0; oh0 < OH; oh0 += DW_ROWS) {
                const int64_t rows = KILN_MIN(DW_ROWS, OH - oh0);
                for (int64_t oh = oh0; oh < oh0 + rows; ++oh)
                    for (int64_t ow0 = 0; ow0 < OW; ow0 += DW_COLS) {
                        kiln_vf acc[DW_BLOCK];
                        for (int v = 0; v < DW_BLOCK; ++v) acc[v] = kiln_dw_init();
                        for (int64_t i = 0; i < KH; ++i)
                            for (int64_t j = 0; j < KW; ++j) {
                                const float* src = planes + kiln_phase(i, j) * (HQ * WQ)
                                                   + (oh + i * DH / SH) * WQ + j * DW / SW + ow0;
                                const float wv = w[i * KW + j];
#pragma GCC unroll 8
                                for (int v = 0; v < DW_BLOCK; ++v)
                                    acc[v] = DW_MAX ? kiln_vmax(acc[v], *(const kiln_vfu*)(src + v * VW))
                                                    : acc[v] + wv * *(const kiln_vfu*)(src + v * VW);
                            }
                        for (int v = 0; v < DW_BLOCK; ++v) *(kiln_vfu*)(stage + (oh - oh0) * OW + ow0 + v * VW) = acc[v];
                    }
                kiln_epilogue_row(ARGS, b, c, oh0 * OW, rows * OW, stage);
            }
        }
        free(stage);
        free(planes);
    }
}
