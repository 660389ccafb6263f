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

/* 64-byte aligned (aligned_alloc wants a size that is a multiple of the alignment) */
static inline float* kiln_alloc(int64_t floats) { return (float*)aligned_alloc(64, (size_t)(floats * 4 + 127) / 64 * 64); }
