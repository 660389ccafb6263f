/* The register-blocked micro-kernel of the CPU GEMM templates (kiln_ops_builtin.templates.gemm_cpu
   tells the algorithm): an MR x NR tile of C in NV vectors per row, kept in registers over k.

   Compile-time knobs, macros of the rendered program: MR_KNOB (the tile's rows; 0 takes the
   ISA's: MR_WIDE with 16-float vectors, 6 with 8, 8 with 4), MC (A's block rows, cut down to
   whole panels: MCB), A_DIRECT (1: A is read in place, row k of a panel at a + aoff[k]; 0: A is
   packed k-major), A_PREFETCH (where A_DIRECT: row k + A_PREFETCH is prefetched at row k, its
   first and last float, two cache lines at most; 0: none).

   Needs simd.h ahead of it. */

/* the tile's rows: chosen by the preprocessor, as the vector width is, since variants test it
   in #if (conv.h's ALIGNED) */
#if MR_KNOB
#define MR MR_KNOB
#elif VW == 16
#define MR MR_WIDE
#elif VW == 8
#define MR 6
#else
#define MR 8
#endif
enum {
    NV = 2,              /* vectors of a tile row */
    NR = NV * VW,        /* the tile's columns */
    MCB = MC / MR * MR,  /* A's blocks in whole panels */
};

/* cout[MR][NR] (row stride ldout) = cin (row stride ldin; zeros where NULL) + a-panel (kc x MR,
   k-major; or, where A_DIRECT, row k at a + aoff[k]: A read in place, A_PREFETCH rows ahead
   prefetched) times b-panel (kc x NR, k-major); meanwhile the `lines` 64-byte cache lines from
   `ahead` on (what the caller reads next: gemm.h's next B panel) prefetched into L2, one every
   kc / lines k, so that they arrive from memory while the tile computes (none where lines is 0;
   at most one a k: the first kc where lines exceed kc, a single A panel's).
   Never inlined: in the loops of its caller GCC keeps one of the 14-row tile's accumulators on
   the stack, a store and a load every k. */
static __attribute__((noinline)) void kiln_micro(int64_t kc, const float* __restrict__ a, const int64_t* __restrict__ aoff,
                              const float* __restrict__ b,
                              const float* cin, int64_t ldin, float* cout, int64_t ldout,
                              const float* ahead, int64_t lines) {
    const int64_t every = lines ? (kc / lines > 0 ? kc / lines : 1) : 0;
    int64_t due = lines ? 0 : kc;        /* the k of the next prefetch (kc: none left) */
    kiln_vf acc[MR][NV];
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
        for (int j = 0; j < NV; ++j) acc[i][j] = cin ? *(const kiln_vfu*)(cin + i * ldin + j * VW) : (kiln_vf){0};
    for (int64_t k = 0; k < kc; ++k) {
        if (k == due) {
            __builtin_prefetch(ahead, 0, 2);
            ahead += 16;
            due = --lines ? due + every : kc;
        }
#if A_DIRECT && A_PREFETCH
        if (k + A_PREFETCH < kc) {
            __builtin_prefetch(a + aoff[k + A_PREFETCH]);
            __builtin_prefetch(a + aoff[k + A_PREFETCH] + MR - 1);
        }
#endif
        kiln_vf bv[NV];
#pragma GCC unroll 4
        for (int j = 0; j < NV; ++j) bv[j] = *(const kiln_vfu*)(b + k * NR + j * VW);
#pragma GCC unroll 16
        for (int i = 0; i < MR; ++i) {
            const float av = A_DIRECT ? a[aoff[k] + i] : a[k * MR + i];
#pragma GCC unroll 4
            for (int j = 0; j < NV; ++j) acc[i][j] += av * bv[j];
        }
    }
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
        for (int j = 0; j < NV; ++j) *(kiln_vfu*)(cout + i * ldout + j * VW) = acc[i][j];
}
