// The atomic combination of kiln_ops_builtin.templates.scatter_atomic: kiln::scatter::combine<P>
// combines a value into its accumulator as the program P's COMBINE says (an enumerator of
// kiln::scatter::Combine; with CAS, P::combined(a, v) is the combination). Ahead of the program,
// whose enumerator names a Combine.

namespace kiln::scatter {

// How a value is combined into its accumulator: atomicAdd, atomicMax, atomicMin, or a loop of
// atomicCAS on the accumulator's bits (P::combined: products, floating-point extrema)
enum Combine { ADD, MAX, MIN, CAS };

// An accumulator type's atomic sum and its bits as the word atomicCAS swaps
template <class T> struct Atomic;
template <> struct Atomic<float> {
    using Word = unsigned int;
    static __device__ __forceinline__ void add(float* p, float v) { atomicAdd(p, v); }
    static __device__ __forceinline__ Word bits(float v) { return __float_as_uint(v); }
    static __device__ __forceinline__ float value(Word w) { return __uint_as_float(w); }
};
template <> struct Atomic<double> {
    using Word = unsigned long long;
    static __device__ __forceinline__ void add(double* p, double v) { atomicAdd(p, v); }
    static __device__ __forceinline__ Word bits(double v) { return (unsigned long long)__double_as_longlong(v); }
    static __device__ __forceinline__ double value(Word w) { return __longlong_as_double((long long)w); }
};
template <> struct Atomic<int32_t> {
    using Word = unsigned int;
    static __device__ __forceinline__ void add(int32_t* p, int32_t v) { atomicAdd(p, v); }
    static __device__ __forceinline__ Word bits(int32_t v) { return (unsigned int)(v); }
    static __device__ __forceinline__ int32_t value(Word w) { return (int32_t)(w); }
};
template <> struct Atomic<int64_t> {
    using Word = unsigned long long;
    static __device__ __forceinline__ void add(int64_t* p, int64_t v) {
        atomicAdd((unsigned long long*)p, (unsigned long long)v);
    }
    static __device__ __forceinline__ Word bits(int64_t v) { return (unsigned long long)(v); }
    static __device__ __forceinline__ int64_t value(Word w) { return (int64_t)(w); }
};

// v combined into *p atomically, as P::COMBINE says
template <class P>
static __device__ __forceinline__ void combine(typename P::Acc* p, typename P::Acc v) {
    using T = typename P::Acc;
    if constexpr (P::COMBINE == ADD) {
        Atomic<T>::add(p, v);
    } else if constexpr (P::COMBINE == MAX) {
        atomicMax(p, v);
    } else if constexpr (P::COMBINE == MIN) {
        atomicMin(p, v);
    } else {
        using Word = typename Atomic<T>::Word;
        Word* word = (Word*)p;
        Word old = *word, seen;
        do {
            seen = old;
            const T a = Atomic<T>::value(seen);
            const Word next = Atomic<T>::bits(P::combined(a, v));
            if (next == seen) return;
            old = atomicCAS(word, seen, next);
        } while (old != seen);
    }
}

}  // namespace kiln::scatter
