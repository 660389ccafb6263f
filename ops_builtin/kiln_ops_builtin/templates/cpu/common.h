/* What the CPU templates' device code shares: OpenMP, the least and the greatest of two sizes,
   panels (a size rounded up to whole w-wide panels, counted), and 64-byte aligned buffers.

   Needs the C prelude (fixed-width integers, aligned_alloc) ahead of it. */

#include <omp.h>

/* Macros, not functions: GCC outlines an OpenMP parallel region before it propagates
   constants, so a size computed ahead of a region (a loop bound, a divisor) stays a constant
   inside it only where it is a constant expression in the source. */
#define KILN_MIN(a, b) ((a) < (b) ? (a) : (b))
#define KILN_MAX(a, b) ((a) > (b) ? (a) : (b))
#define KILN_PANELS(x, w) (((x) + (w) - 1) / (w))    /* the w-wide panels that hold x */
/* First in the body of a loop over a tile's rows (or channels) that hands each to the epilogue
   hook: GCC vectorizes no loop with an asm statement in it. Else, where the hook's loop runs a
   constant count (unrolled whole), GCC vectorized the outer loop across rows, a lane a row:
   strided loads put together by shuffles and a store per element (vextractps), a quarter of
   ResNet-50's 1x1 GEMM steps on AVX2, where a row's run is one vector load, add and store.
   Nothing where the hook calls libm (EPILOGUE_LIBM, a macro of the program: GELU's erf): the
   hook's own loop is `omp simd` there (cpu_hooks.render_epilogue_row), a lane a column, calling
   glibc's vector variant (BERT at one thread on AVX2: 0.954x the time of a loop across rows). */
#if EPILOGUE_LIBM
#define KILN_ROW_BY_ROW()
#else
#define KILN_ROW_BY_ROW() __asm__ volatile("" ::: "memory")
#endif

/* 64-byte aligned (aligned_alloc wants a size that is a multiple of the alignment) */
static inline float* kiln_alloc(int64_t floats) { return (float*)aligned_alloc(64, (size_t)(floats * 4 + 127) / 64 * 64); }
