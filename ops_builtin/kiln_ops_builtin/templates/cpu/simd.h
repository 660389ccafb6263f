/* The C vector types of the CPU templates, on the host's widest vectors, and vector math on them.

   VW: float lanes (16 with AVX-512, 8 with AVX, else 4); kiln_vf: VW floats, aligned; kiln_vfu:
   the same, unaligned; kiln_vi: VW int32, what a comparison of two kiln_vf gives (all bits set
   where true). The lane count picks the vector type, so it is the one knob the preprocessor
   chooses (from the compiler's target), with KILN_ZIP_LO / KILN_ZIP_HI: the shuffle masks
   interleaving the first halves and the second halves of two vectors.

   Needs the C prelude (fixed-width integers, INFINITY) ahead of it. */

#if defined(__AVX512F__)
#define VW 16
#elif defined(__AVX__)
#define VW 8
#else
#define VW 4
#endif
typedef float kiln_vf __attribute__((vector_size(VW * 4)));
typedef float kiln_vfu __attribute__((vector_size(VW * 4), aligned(4)));
typedef int32_t kiln_vi __attribute__((vector_size(VW * 4)));

/* a where mask, else b (C has no vector ?:) */
static inline kiln_vf kiln_vsel(kiln_vi mask, kiln_vf a, kiln_vf b) {
    return (kiln_vf)((mask & (kiln_vi)a) | (~mask & (kiln_vi)b));
}
/* lane by lane; NaN propagated as the C prelude's max does: a NaN a, else a NaN b */
static inline kiln_vf kiln_vmax(kiln_vf a, kiln_vf b) { return kiln_vsel((a > b) | (a != a), a, b); }
/* across the lanes */
static inline float kiln_vhmax(kiln_vf v) {
    float top = v[0];
    for (int e = 1; e < VW; ++e) top = v[e] > top ? v[e] : top;
    return top;
}
static inline float kiln_vhsum(kiln_vf v) {
    float total = 0.f;
    for (int e = 0; e < VW; ++e) total += v[e];
    return total;
}
#if VW == 16
#define KILN_ZIP_LO {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23}
#define KILN_ZIP_HI {8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31}
#elif VW == 8
#define KILN_ZIP_LO {0, 8, 1, 9, 2, 10, 3, 11}
#define KILN_ZIP_HI {4, 12, 5, 13, 6, 14, 7, 15}
#else
#define KILN_ZIP_LO {0, 4, 1, 5}
#define KILN_ZIP_HI {2, 6, 3, 7}
#endif
/* VW vectors as the rows of a VW x VW block, transposed in registers: log2(VW) rounds of
   interleaving the first half of the rows with the second */
static inline void kiln_vtranspose(kiln_vf* r) {
    const kiln_vi lo = KILN_ZIP_LO, hi = KILN_ZIP_HI;
#pragma GCC unroll 4
    for (int round = 1; round < VW; round *= 2) {
        kiln_vf t[VW];
#pragma GCC unroll 16
        for (int i = 0; i < VW / 2; ++i) {
            t[2 * i] = __builtin_shuffle(r[i], r[i + VW / 2], lo);
            t[2 * i + 1] = __builtin_shuffle(r[i], r[i + VW / 2], hi);
        }
#pragma GCC unroll 16
        for (int i = 0; i < VW; ++i) r[i] = t[i];
    }
}
/* float32 exp lane by lane within 2 ulp, Cephes' polynomial after a reduction by ln 2: 0 below
   -87.3 (exp(-inf) is 0), inf above 88.37, NaN stays NaN */
static inline kiln_vf kiln_vexp(kiln_vf x) {
    const kiln_vf hi = (kiln_vf){0} + 88.3762626647949f, lo = (kiln_vf){0} - 87.3365447504f;
    const kiln_vf c = kiln_vsel(x > hi, hi, kiln_vsel(x < lo, lo, x));
    const kiln_vf t = c * 1.44269504088896341f + 12582912.0f;    /* 1.5 * 2^23: t's low bits hold round(c / ln 2) */
    const kiln_vf n = t - 12582912.0f;
    const kiln_vf r = c - n * 0.693359375f + n * 2.12194440e-4f;
    kiln_vf y = r * 1.9875691500e-4f + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * r * r + r + 1.0f;
    const kiln_vf scale = (kiln_vf)(((kiln_vi)t - 0x4B400000 + 127) << 23);
    const kiln_vf inf = (kiln_vf){0} + INFINITY;
    return kiln_vsel(x < lo, (kiln_vf){0}, kiln_vsel(x > hi, inf, y * scale));
}
