/* The register-blocked micro-kernel of the CPU GEMM templates (kiln_ops_builtin.templates.gemm_cpu
   tells the algorithm): an MR x NR tile of C in NV vectors per row, kept in registers over k.

   Compile-time knobs, macros of the rendered program: MR_KNOB (the tile's rows; 0 takes the
   ISA's: MR_WIDE with 16-float vectors, 6 with 8, 8 with 4), MC (A's block rows, cut down to
   whole panels: MCB), A_DIRECT (1: A is read in place, as a convolution's taps: A_TAPS, A_CHANNEL
   and A_TAP(t) below; 0: A is packed k-major), A_PREFETCH (where A_DIRECT: the rows A_PREFETCH
   ahead, rounded up to whole channels, prefetched, each row's first and last float, two cache
   lines at most; 0: none).

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

enum {
    KILN_CHAINS = 12,                   /* accumulators that keep the FMA units busy (latency x units, with slack) */
    KILN_REGISTERS = VW == 16 ? 32 : 16,
    KILN_SHORT_ROWS = 4,                /* the most rows of kiln_micro_short's tiles */
};
/* the sets of accumulators of an R-row tile (its k dealt out to them in turn): R x NV x sets
   reach KILN_CHAINS independent chains of multiply-adds, within the registers (B's NV vectors
   and a broadcast besides) */
#define KILN_PHASES(R) KILN_MAX(1, KILN_MIN((KILN_CHAINS + (R) * NV - 1) / ((R) * NV), \
                                            (KILN_REGISTERS - NV - 1) / ((R) * NV)))
#define KILN_PHASES_MAX KILN_PHASES(1)

/* cout[R][NR] (row stride ldout) = cin (row stride ldin; zeros where NULL) + a-panel times
   b-panel (kc x NR, k-major), R (a constant, at most MR) of the panel's MR rows; meanwhile the
   `lines` 64-byte cache lines from `ahead` on (what the caller reads next: gemm.h's next B
   panel) prefetched into L2, one every kc / lines k, so that they arrive from memory while the
   tile computes (none where lines is 0; at most one a k: the first kc where lines exceed kc, a
   single A panel's).
   The a-panel: kc x MR, k-major; or, where A_DIRECT, A read in place, as a convolution's taps
   (A_TAPS rows of k to an input channel, kc a whole number of channels): row k = c * A_TAPS + t
   at a + c * A_CHANNEL + A_TAP(t), the taps' offsets constants of the program, so that the
   loop over a channel's taps, unrolled, reads A at fixed offsets from one pointer (a table of
   offsets cost a load a k, and the loads, not the multiply-adds, bounded the loop: AVX2's 6 x 16
   tile ran at 60% of the FMA peak); each row's first and last float prefetched A_PREFETCH rows
   ahead (in whole channels; 0: none).
   With P phases (packed A only), consecutive k go to P sets of accumulators in turn, summed at
   the end: a tile of few rows has too few accumulators to hide the multiply-add's latency.
   The k run in stretches between two prefetches of `ahead`, each stretch a loop of its own with
   no test in it (a test a k cost AVX2's 6 x 16 tile about a sixth of its speed). */
#if A_DIRECT
enum {
    KILN_A_AHEAD = (A_PREFETCH + A_TAPS - 1) / A_TAPS,     /* channels ahead prefetched */
    KILN_A_UNROLL = A_TAPS >= 4 ? 1 : 4,                    /* channels a loop body (the taps unrolled) */
};
#endif
static inline __attribute__((always_inline)) void kiln_tile(
        const int R, const int P, int64_t kc, const float* __restrict__ a, const float* __restrict__ b,
        const float* cin, int64_t ldin, float* cout, int64_t ldout, const float* ahead, int64_t lines) {
#if A_DIRECT
    const int64_t rows = kc / A_TAPS;     /* the loops below count channels */
#else
    const int64_t rows = kc;
#endif
    const int64_t every = lines ? (rows / lines > 0 ? rows / lines : 1) : rows;
    kiln_vf acc[KILN_PHASES_MAX][MR][NV];
#pragma GCC unroll 16
    for (int p = 0; p < P; ++p)
#pragma GCC unroll 16
        for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
            for (int j = 0; j < NV; ++j)
                acc[p][i][j] = cin && p == 0 ? *(const kiln_vfu*)(cin + i * ldin + j * VW) : (kiln_vf){0};
    for (int64_t r0 = 0; r0 < rows; r0 += every) {
        if (lines > 0) {
            __builtin_prefetch(ahead, 0, 2);
            ahead += 16;
            --lines;
        }
        const int64_t r1 = KILN_MIN(rows, r0 + every);
#if A_DIRECT
#pragma GCC unroll KILN_A_UNROLL
        for (int64_t c = r0; c < r1; ++c) {
            const float* __restrict__ ac = a + c * A_CHANNEL;
            const float* __restrict__ bc = b + c * A_TAPS * NR;
#pragma GCC unroll 64
            for (int t = 0; t < A_TAPS; ++t) {
                /* no value carried from one tap to the next: where taps overlap (a stride of 1),
                   GCC would keep A's floats for the next tap in registers, and spill the tile */
                __asm__ volatile("" ::: "memory");
                if (KILN_A_AHEAD) {     /* past the block's end too: a prefetch never faults */
                    __builtin_prefetch(ac + KILN_A_AHEAD * A_CHANNEL + A_TAP(t));
                    __builtin_prefetch(ac + KILN_A_AHEAD * A_CHANNEL + A_TAP(t) + MR - 1);
                }
                kiln_vf bv[NV];
#pragma GCC unroll 4
                for (int j = 0; j < NV; ++j) bv[j] = *(const kiln_vfu*)(bc + t * NR + j * VW);
#pragma GCC unroll 16
                for (int i = 0; i < R; ++i) {
                    const float av = ac[A_TAP(t) + i];
#pragma GCC unroll 4
                    for (int j = 0; j < NV; ++j) acc[0][i][j] += av * bv[j];
                }
            }
        }
#else
        int64_t k = r0;
#pragma GCC unroll 4
        for (; k + P <= r1; k += P)
#pragma GCC unroll 16
            for (int p = 0; p < P; ++p) {
                kiln_vf bv[NV];
#pragma GCC unroll 4
                for (int j = 0; j < NV; ++j) bv[j] = *(const kiln_vfu*)(b + (k + p) * NR + j * VW);
#pragma GCC unroll 16
                for (int i = 0; i < R; ++i) {
                    const float av = a[(k + p) * MR + i];
#pragma GCC unroll 4
                    for (int j = 0; j < NV; ++j) acc[p][i][j] += av * bv[j];
                }
            }
        for (; k < r1; ++k) {
            kiln_vf bv[NV];
#pragma GCC unroll 4
            for (int j = 0; j < NV; ++j) bv[j] = *(const kiln_vfu*)(b + k * NR + j * VW);
#pragma GCC unroll 16
            for (int i = 0; i < R; ++i) {
                const float av = a[k * MR + i];
#pragma GCC unroll 4
                for (int j = 0; j < NV; ++j) acc[0][i][j] += av * bv[j];
            }
        }
#endif
    }
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
        for (int j = 0; j < NV; ++j) {
#pragma GCC unroll 16
            for (int p = 1; p < P; ++p) acc[0][i][j] += acc[p][i][j];
            *(kiln_vfu*)(cout + i * ldout + j * VW) = acc[0][i][j];
        }
}

/* The MR x NR tile (kiln_tile). Never inlined: in the loops of its caller GCC keeps one of the
   14-row tile's accumulators on the stack, a store and a load every k. */
static __attribute__((noinline)) void kiln_micro(int64_t kc, const float* __restrict__ a, const float* __restrict__ b,
                                                 const float* cin, int64_t ldin, float* cout, int64_t ldout,
                                                 const float* ahead, int64_t lines) {
    kiln_tile(MR, 1, kc, a, b, cin, ldin, cout, ldout, ahead, lines);
}

#if !A_DIRECT
/* The first `rows` (1 .. KILN_SHORT_ROWS, fewer than MR) rows of the tile, with kiln_tile's phases: an
   M's last panel, whose padding rows the full tile would compute (BERT's M = 128 on AVX2's 6 rows:
   22 panels, 132 rows). The rows of cout past them are left as they were. */
static __attribute__((noinline)) void kiln_micro_short(int64_t rows, int64_t kc, const float* __restrict__ a,
                                                       const float* __restrict__ b, const float* cin, int64_t ldin,
                                                       float* cout, int64_t ldout, const float* ahead, int64_t lines) {
#define KILN_SHORT(R) kiln_tile(R < MR ? R : MR, KILN_PHASES(R), kc, a, b, cin, ldin, cout, ldout, ahead, lines)
    switch (rows) {
        case 1: KILN_SHORT(1); break;
        case 2: KILN_SHORT(2); break;
        case 3: KILN_SHORT(3); break;
        default: KILN_SHORT(4); break;
    }
#undef KILN_SHORT
}
#endif
