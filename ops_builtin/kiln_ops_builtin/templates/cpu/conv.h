/* conv2d as an implicit GEMM on gemm.h (kiln_ops_builtin.templates.conv_cpu tells the algorithm):
   A's rows are output pixels, read from the phase planes (planes.h) at a tap's offset, in place
   or gathered; B is the weight; finished tiles go to the epilogue hook a channel at a time.

   The problem, macros of the rendered program: the input's CIN, H, W, the window's KH, KW,
   strides SH, SW, dilation DH, DW and padding PH, PW, the output's OH, OW, the planes' HQ, WQ
   and PLANE (an image's floats), GROUPS (a GEMM batch per image and group) and IMAGES; with
   conv_rows.h's rows. PARAMS (gemm.h's) ends with `planes` and `koffs`, the planes and each
   tap's offset in them (kiln_koff: what kiln_pack_a gathers; micro.h reads A in place at conv_rows.h's
   A_TAP offsets). TASK_PARAMS are the task's buffers (TASK_ARGS passes them).

   Defines gemm.h's kiln_pack_a and its staging of tiles, so it comes ahead of gemm.h; needs
   conv_rows.h, micro.h and the hooks ahead of it. */

/* planes offset of tap k = (c, i, j) */
static inline int64_t kiln_koff(int64_t k) { return k / A_TAPS * A_CHANNEL + A_TAP(k % A_TAPS); }

/* the planes of GEMM batch b: image b / GROUPS, the input channels of group b % GROUPS (where
   LAST_COPIED, planes holds the last image alone, the others are the input's) */
static inline const float* kiln_group_planes(PARAMS, int64_t b) {
    const int64_t image = b / GROUPS;
    const float* at = !LAST_COPIED ? planes + image * PLANE
                      : image < IMAGES - 1 ? (const float*)INPUT_PLANES + image * INPUT_IMAGE : planes;
    return at + b % GROUPS * (CIN / GROUPS) * PSH * PSW * HQ * WQ;
}

/* A_DIRECT: A read in place from row k0 on (k0 a whole number of channels), the panel at m0 at
   the planes' pixel m0 (a real pixel where ALIGNED, its panel within one output row; else a
   virtual one); micro.h adds each tap's offset */
static inline const float* kiln_a_rows(PARAMS, int64_t b, int64_t m0, int64_t k0) {
    return kiln_group_planes(ARGS, b) + k0 / A_TAPS * A_CHANNEL + (ALIGNED ? m0 / OW * WQ + m0 % OW : m0);
}

/* real pixels, not ALIGNED (gather): A's rows m0 .. m0 + rows - 1 gathered tap by tap (the rows past them
   repeat pixel 0: computed, never stored) */
static void kiln_pack_a(PARAMS, int64_t b, int64_t m0, int64_t rows, int64_t k0, int64_t kc,
                        float* __restrict__ dst) {
    const float* src = kiln_group_planes(ARGS, b);
    const int64_t* __restrict__ off = koffs + k0;
    int64_t at[MR];
    for (int64_t i = 0; i < MR; ++i) at[i] = i < rows ? (m0 + i) / OW * WQ + (m0 + i) % OW : 0;
    for (int64_t k = 0; k < kc; ++k)
#pragma GCC unroll 16
        for (int64_t i = 0; i < MR; ++i) dst[k * MR + i] = src[off[k] + at[i]];
}

/* Finished tiles are staged (gemm.h's STAGED_TILES): a B panel's tiles over A's block, transposed
   into a row of STAGE_ROW floats for each of the panel's channels, then each channel's runs of
   real pixels through the epilogue hook at once. A run is the block's rows of an output row (of
   virtual pixels), or all of them (real pixels, consecutive in the output): handed a tile at a
   time, a run was a few pixels (AVX2's 6-row tile), computed by the hook's scalar code
   (ResNet-50 b8's 1x1 convolutions with a residual add: a quarter of their time). */
#define STAGED_TILES 1
enum {
    STAGE_ROW = (MCB + VW - 1) / VW * VW + VW,    /* a block's rows, whole vectors, and a vector of slack */
    STAGE_FLOATS = NR * STAGE_ROW,
};

/* a finished tile, row r of the block its first, into the stage: transposed VW x VW in registers,
   each vector stored whole (vector stores, which the epilogue's vector loads can take forwarded:
   element-wise stores could not; lanes past MR hold zeros, which the block's next tile
   overwrites, or the slack) */
static inline void kiln_stage_tile(int64_t r, const float* __restrict__ tile, float* __restrict__ stage) {
#pragma GCC unroll 2
    for (int64_t i0 = 0; i0 < MR; i0 += VW)
#pragma GCC unroll 4
        for (int g = 0; g < NV; ++g) {
            kiln_vf v[VW];
#pragma GCC unroll 16
            for (int i = 0; i < VW; ++i) v[i] = i0 + i < MR ? *(const kiln_vf*)(tile + (i0 + i) * NR + g * VW) : (kiln_vf){0};
            kiln_vtranspose(v);
#pragma GCC unroll 16
            for (int j = 0; j < VW; ++j) *(kiln_vfu*)(stage + (g * VW + j) * STAGE_ROW + r + i0) = v[j];
        }
}

/* the stage of the rows ic .. ic + mc - 1 and channels n0 .. n0 + cols - 1 of GEMM batch b (of its
   group's output channels): each channel's runs of real pixels through the epilogue hook */
static inline void kiln_store_stage(PARAMS, int64_t b, int64_t ic, int64_t mc, int64_t n0, int64_t cols,
                                    const float* __restrict__ stage) {
    for (int64_t j = 0; j < cols; ++j) {
        KILN_ROW_BY_ROW();
        const float* row = stage + j * STAGE_ROW;
        const int64_t m = b % GROUPS * N + n0 + j;
        if (ROW == OW)
            kiln_epilogue_row(ARGS, b / GROUPS, m, ic, mc, row);
        else
            for (int64_t v = ic, end = ic + mc; v < end;) {
                const int64_t oh = v / ROW, ow = v % ROW, run = KILN_MIN(end - v, ROW - ow);
                if (ow < OW) kiln_epilogue_row(ARGS, b / GROUPS, m, oh * OW + ow, KILN_MIN(run, OW - ow), row + (v - ic));
                v += run;
            }
    }
}
