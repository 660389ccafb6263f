// kiln_k0 sm_90 ('-std=c++17', '-default-device', '-diag-suppress=177')

typedef signed char int8_t;
typedef unsigned char uint8_t;
typedef short int16_t;
typedef unsigned short uint16_t;
typedef int int32_t;
typedef unsigned int uint32_t;
typedef long long int64_t;
typedef unsigned long long uint64_t;
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif
#ifndef NAN
#define NAN __int_as_float(0x7fffffff)
#endif
#ifndef INT64_MIN
#define INT64_MIN (-9223372036854775807LL - 1)
#endif

static __device__ __forceinline__ float kiln_h2f(uint16_t h) {
    float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f;
}
static __device__ __forceinline__ uint16_t kiln_f2h(float f) {
    uint16_t h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h;
}
static __device__ __forceinline__ float kiln_bf2f(uint16_t b) { return __uint_as_float(((uint32_t)b) << 16); }
static __device__ __forceinline__ uint16_t kiln_f2bf(float f) {
    uint16_t h; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h;
}
template <typename T, int V>
struct alignas(sizeof(T) * V < 16 ? sizeof(T) * V : 16) kiln_pack { T v[V]; };
#define KILN_FLOAT_HELPERS(T, K, S)                                                   \
static __device__ __forceinline__ T kiln_max_##K(T a, T b) { return (a > b || a != a) ? a : b; }          \
static __device__ __forceinline__ T kiln_min_##K(T a, T b) { return (a < b || a != a) ? a : b; }          \
static __device__ __forceinline__ T kiln_mod_##K(T a, T b) {                                              \
    T m = fmod##S(a, b);                                                              \
    if (m != 0 && ((b < 0) != (m < 0))) m += b;                                       \
    return m;                                                                         \
}                                                                                     \
static __device__ __forceinline__ T kiln_floordiv_##K(T a, T b) {                                         \
    if (b == 0) return a / b;                                                         \
    T m = fmod##S(a, b);                                                              \
    T d = (a - m) / b;                                                                \
    if (m != 0 && ((b < 0) != (m < 0))) d -= 1;                                       \
    if (d == 0) return copysign##S((T)0, a / b);                                      \
    T f = floor##S(d);                                                                \
    if (d - f > (T)0.5) f += 1;                                                       \
    return f;                                                                         \
}
KILN_FLOAT_HELPERS(float, f, f)
KILN_FLOAT_HELPERS(double, d, )

static __device__ __forceinline__ int64_t kiln_floordiv_i64(int64_t a, int64_t b) {
    if (b == 0) return 0;
    if (b == -1) return (int64_t)(0 - (uint64_t)a);
    int64_t q = a / b;
    if ((a % b != 0) && ((a < 0) != (b < 0))) q -= 1;
    return q;
}
static __device__ __forceinline__ int64_t kiln_mod_i64(int64_t a, int64_t b) {
    if (b == 0 || b == -1) return 0;
    int64_t m = a % b;
    if (m != 0 && ((b < 0) != (m < 0))) m += b;
    return m;
}
static __device__ __forceinline__ int64_t kiln_div_i64(int64_t a, int64_t b) {
    if (b == 0) return 0;
    if (b == -1) return (int64_t)(0 - (uint64_t)a);
    return a / b;
}
static __device__ __forceinline__ int64_t kiln_fmod_i64(int64_t a, int64_t b) { return (b == 0 || b == -1) ? 0 : a % b; }
static __device__ __forceinline__ int64_t kiln_pow_i64(int64_t a, int64_t b) {
    if (b < 0) return a == 1 ? 1 : (a == -1 ? ((b & 1) ? -1 : 1) : 0);
    int64_t r = 1;
    while (b) { if (b & 1) r *= a; a *= a; b >>= 1; }
    return r;
}
static __device__ __forceinline__ int64_t kiln_max_i64(int64_t a, int64_t b) { return a > b ? a : b; }
static __device__ __forceinline__ int64_t kiln_min_i64(int64_t a, int64_t b) { return a < b ? a : b; }

extern "C" __global__ void __launch_bounds__(256) kiln_k0(const uint16_t* __restrict__ in0, uint16_t* __restrict__ out0) {
    for (int64_t o = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5; o < 672; o += ((int64_t)gridDim.x * blockDim.x) >> 5) {
        float acc1 = 0.0f;
        const int64_t v3 = (((int64_t)0LL) + ((int64_t)1LL));
        const int64_t v4 = (v3 * ((int64_t)14LL));
        const int64_t v5 = (v4 + ((int64_t)1LL));
        const int64_t v6 = (v5 - ((int64_t)1LL));
        const int64_t v7 = (v6 / ((int64_t)1LL));
        const int64_t v8 = (((int64_t)0LL) * ((int64_t)14LL));
        const int64_t v9 = (v8 / ((int64_t)1LL));
        const int64_t v10 = (v7 - v9);
        #pragma unroll 4
        for (int64_t f11 = 0 + (threadIdx.x & 31); f11 < (int64_t)(v10) * (int64_t)(v10); f11 += 32) {
            const int64_t r12 = f11 % (v10);
            const int64_t r13 = (f11 / ((v10))) % (v10);
            const int64_t v14 = (r13 * ((int64_t)9408LL));
            const int64_t v15 = (r12 * ((int64_t)672LL));
            const int64_t v16 = (v14 + v15);
            const int64_t v17 = (v16 + o);
            const float v18 = kiln_h2f(in0[v17]);
            const float v19 = ((float)(v18));
            acc1 = acc1 + v19;
        }
        for (int kiln_m = 16; kiln_m > 0; kiln_m >>= 1) {
            const float o20 = __shfl_xor_sync(0xffffffffu, acc1, kiln_m);
            acc1 = acc1 + o20;
        }
        const float v21 = (acc1 / 196.0f);
        const float v22 = kiln_h2f(kiln_f2h((float)(v21)));
        if ((threadIdx.x & 31) == 0) out0[o] = kiln_f2h(v22);
    }
}
