/* How the plain GEMM (kiln_ops_builtin.templates.gemm_cpu) reads A's panels and writes its
   finished tiles, through the core's hooks kiln_a and kiln_epilogue_row; a template that reads
   A otherwise or stores tiles otherwise (conv.h) defines these two itself.

   Needs micro.h and the hooks ahead of it. */

/* A's rows m0 .. m0 + rows - 1 (zeros past them) for k0 .. k0 + kc - 1, as one k-major MR-tall panel */
static void kiln_pack_a(PARAMS, int64_t b, int64_t m0, int64_t rows, int64_t k0, int64_t kc,
                        float* __restrict__ dst) {
    for (int64_t k = 0; k < kc; ++k)
        for (int64_t i = 0; i < MR; ++i)
            dst[k * MR + i] = i < rows ? kiln_a(ARGS, b, m0 + i, k0 + k) : 0.f;
}

#define STAGED_TILES 0    /* gemm.h: each tile stored when it is finished */

/* a finished tile: its rows through the epilogue hook (full rows a vector at a time, a constant
   count, which the hook's loop then takes in one vector: not a call of memcpy, nor GCC's inline
   `rep movs` for a constant 32 floats) */
static inline void kiln_store_tile(PARAMS, int64_t b, int64_t m0, int64_t n0, int64_t rows, int64_t cols,
                                   const float* __restrict__ tile) {
    if (cols == NR)
        for (int64_t i = 0; i < rows; ++i) {
            KILN_ROW_BY_ROW();
#pragma GCC unroll 4
            for (int j = 0; j < NV; ++j) kiln_epilogue_row(ARGS, b, m0 + i, n0 + j * VW, VW, tile + i * NR + j * VW);
        }
    else
        for (int64_t i = 0; i < rows; ++i) kiln_epilogue_row(ARGS, b, m0 + i, n0, cols, tile + i * NR);
}
