"""The C dialect: the prelude of helpers every CPU kernel starts with, and the order of a CPU
template's program."""
from __future__ import annotations

from collections.abc import Sequence

from kiln.codegen.emitter import Dialect

C_PRELUDE = r"""
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* glibc's vector math (libmvec, linked through -lm) for loops the compiler vectorizes: each
   function declared SIMD-callable, so a loop calling it takes 4, 8 or 16 lanes per call of the
   vector variant (within 4 ulp) instead of one call per element. exp, log, sin and cos have
   vector variants since glibc 2.22, the others since 2.35. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__GLIBC__) \
    && (__GLIBC__ > 2 || __GLIBC_MINOR__ >= 22)
#define KILN_SIMD_FN(f) __attribute__((simd("notinbranch"), const, nothrow)) float f(float);
KILN_SIMD_FN(expf) KILN_SIMD_FN(logf) KILN_SIMD_FN(sinf) KILN_SIMD_FN(cosf)
#if __GLIBC__ > 2 || __GLIBC_MINOR__ >= 35
KILN_SIMD_FN(expm1f) KILN_SIMD_FN(log1pf) KILN_SIMD_FN(log2f) KILN_SIMD_FN(tanf) KILN_SIMD_FN(tanhf)
KILN_SIMD_FN(erff) KILN_SIMD_FN(asinf) KILN_SIMD_FN(acosf) KILN_SIMD_FN(atanf) KILN_SIMD_FN(sinhf)
KILN_SIMD_FN(coshf) KILN_SIMD_FN(asinhf) KILN_SIMD_FN(acoshf) KILN_SIMD_FN(atanhf)
#endif
#endif

static inline float kiln_h2f(uint16_t h) { _Float16 v; memcpy(&v, &h, 2); return (float)v; }
static inline uint16_t kiln_f2h(float f) { _Float16 v = (_Float16)f; uint16_t h; memcpy(&h, &v, 2); return h; }
static inline float kiln_bf2f(uint16_t b) { uint32_t u = ((uint32_t)b) << 16; float f; memcpy(&f, &u, 4); return f; }
static inline uint16_t kiln_f2bf(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* A failed check: the first failing thread's code and value go to the status buffer. */
static inline void kiln_fail(int64_t* status, int64_t code, int64_t value) {
    int64_t none = 0;
    if (__atomic_compare_exchange_n(&status[0], &none, code, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED))
        status[1] = value;
}

/* max and min propagate NaN (a NaN a, else a NaN b), chosen by a bit mask, not a branch: a
   branch mispredicts on ReLU's random signs and keeps the loop from vectorizing */
#define KILN_FLOAT_HELPERS(T, K, S, U)                                                \
static inline T kiln_pick_##K(int take_a, T a, T b) {                                 \
    U x, y;                                                                           \
    memcpy(&x, &a, sizeof x);                                                         \
    memcpy(&y, &b, sizeof y);                                                         \
    const U mask = -(U)take_a, r = (x & mask) | (y & ~mask);                          \
    T out;                                                                            \
    memcpy(&out, &r, sizeof out);                                                     \
    return out;                                                                       \
}                                                                                     \
static inline T kiln_max_##K(T a, T b) { return kiln_pick_##K((a > b) | (a != a), a, b); } \
static inline T kiln_min_##K(T a, T b) { return kiln_pick_##K((a < b) | (a != a), a, b); } \
static inline T kiln_mod_##K(T a, T b) {                                              \
    T m = fmod##S(a, b);                                                              \
    if (m != 0 && ((b < 0) != (m < 0))) m += b;                                       \
    return m;                                                                         \
}                                                                                     \
static inline T kiln_floordiv_##K(T a, T b) {                                         \
    if (b == 0) return a / b;                                                         \
    T m = fmod##S(a, b);                                                              \
    T d = (a - m) / b;                                                                \
    if (m != 0 && ((b < 0) != (m < 0))) d -= 1;                                       \
    if (d == 0) return copysign##S((T)0, a / b);                                      \
    T f = floor##S(d);                                                                \
    if (d - f > (T)0.5) f += 1;                                                       \
    return f;                                                                         \
}
KILN_FLOAT_HELPERS(float, f, f, uint32_t)
KILN_FLOAT_HELPERS(double, d, , uint64_t)

static inline int64_t kiln_floordiv_i64(int64_t a, int64_t b) {
    if (b == 0) return 0;
    if (b == -1) return (int64_t)(0 - (uint64_t)a);
    int64_t q = a / b;
    if ((a % b != 0) && ((a < 0) != (b < 0))) q -= 1;
    return q;
}
static inline int64_t kiln_mod_i64(int64_t a, int64_t b) {
    if (b == 0 || b == -1) return 0;
    int64_t m = a % b;
    if (m != 0 && ((b < 0) != (m < 0))) m += b;
    return m;
}
static inline int64_t kiln_div_i64(int64_t a, int64_t b) {
    if (b == 0) return 0;
    if (b == -1) return (int64_t)(0 - (uint64_t)a);
    return a / b;
}
static inline int64_t kiln_fmod_i64(int64_t a, int64_t b) { return (b == 0 || b == -1) ? 0 : a % b; }
static inline int64_t kiln_pow_i64(int64_t a, int64_t b) {
    if (b < 0) return a == 1 ? 1 : (a == -1 ? ((b & 1) ? -1 : 1) : 0);
    int64_t r = 1;
    while (b) { if (b & 1) r *= a; a *= a; b >>= 1; }
    return r;
}
static inline int64_t kiln_max_i64(int64_t a, int64_t b) { return a > b ? a : b; }
static inline int64_t kiln_min_i64(int64_t a, int64_t b) { return a < b ? a : b; }
"""


def c_template_source(code: Sequence[str], knobs: dict, hooks: str = "") -> str:
    """The C source of a CPU template's program, in the one order every CPU template uses: the
    prelude, its knobs and sizes as `#define NAME value` lines, the fusion hooks the core
    rendered for the task, then its device code (files of `kiln.template.device_code`, then the
    exported functions), which reads the knobs as macros and calls the hooks."""
    head = "".join(f"#define {name} {value}\n" for name, value in knobs.items())
    return C_PRELUDE + head + hooks + "".join(code)


class CDialect(Dialect):
    """C99 for gcc or clang, with OpenMP."""

    prelude = C_PRELUDE
