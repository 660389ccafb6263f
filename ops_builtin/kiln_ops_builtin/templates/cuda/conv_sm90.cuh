// The producer of kiln_ops_builtin.templates.conv_sm90 where x is gathered (its docstring tells
// how): kiln::conv_sm90::Gather<P>, the Gather of the engine's program P (cuda/sm90_engine.cuh),
// whose 128 producer threads copy the im2col of x into the ring's 128-byte-swizzled K-major A
// stages with cp.async. Thread tid copies 16-byte column tid % 8 of rows tid / 8 + 16 i: EPC
// channels of one tap (8 of 16-bit x, 4 of float32 x, which the consumers read as TF32).
// Float32 x (TF32 = 1) is rounded to TF32 in the stage once it lands, by the thread that copied
// it, a slot later: the tensor cores would read it by dropping the low 13 bits, which makes
// every product smaller and, over the layers of a network, its outputs (cuDNN rounds to nearest).
//
// Needs, ahead of it, the PTX wrappers CP_ASYNC and MBARRIER, the macros K, M, PARAMS and KERNEL_ARGS,
// and, ahead of a use, these members of P (conv_sm90.py renders them):
//   BK                         16-bit units of a stage's row (128 bytes)
//   EPC                        x's elements in a 16-byte copy
//   H, W, C, KW, OH, OW        x's height, width and channels, the kernel's width, the output's size
//   SH, SW, PH, PW, DH, DW     stride, padding and dilation
//   RPT                        rows gathered per producer thread
//   TF32                       1 where x is float32, rounded to TF32 as it lands
//   x(KERNEL_ARGS)             x, the input read (a pointer to 16-bit units or to floats)

namespace kiln::conv_sm90 {

// the window's top-left pixel offset and its (y, x), packed as y * 65536 + (x & 0xFFFF), of the
// rows r0 + 16 i of the tile at m0 (rows past the M = `rows` pixels: far out of bounds)
template <class P>
static __device__ __forceinline__ void rows_at(int64_t m0, int64_t rows, int r0, int* pix, int* yx) {
#pragma unroll
    for (int i = 0; i < P::RPT; ++i) {
        const int m = (int)m0 + r0 + 16 * i, b = m / (P::OH * P::OW), p = m - b * (P::OH * P::OW);
        const int oy = p / P::OW, ox = p - oy * P::OW, iy = oy * P::SH - P::PH, ix = ox * P::SW - P::PW;
        pix[i] = ((b * P::H + iy) * P::W + ix) * P::C;
        yx[i] = m < rows ? iy * 65536 + (ix & 0xFFFF) : (int)0x80008000;
    }
}

// 16-byte column j (EPC channels of one tap) of the k-slice at k0 for the rows r0 + 16 i,
// into the 128-byte-swizzled K-major stage `as`, whose row r0 holds that column at 16-bit unit `at`
template <class P, class T>
static __device__ __forceinline__ void gather(const T* x, uint16_t* as, int k0, int j, int at, const int* pix,
                                              const int* yx) {
    static_assert(sizeof(T) * P::EPC == 16, "a copy is 16 bytes of x");
    const int k = k0 + j * P::EPC, tap = k / P::C, ch = k - tap * P::C, ry = tap / P::KW, rx = tap - ry * P::KW;
    const int dy = ry * P::DH, dx = rx * P::DW, shift = (dy * P::W + dx) * P::C + ch;
    uint16_t* dst = as + at;
#pragma unroll
    for (int i = 0; i < P::RPT; ++i) {
        const int iy = (yx[i] >> 16) + dy, ix = (int)(int16_t)yx[i] + dx;
        const bool ok = k < K && (unsigned)iy < (unsigned)P::H && (unsigned)ix < (unsigned)P::W;
        kiln_cp_async16(dst + i * 16 * P::BK, x + (ok ? (int64_t)pix[i] + shift : 0), ok ? 16 : 0);
    }
}

// The four floats at shared address `addr` rounded to TF32 in place, to nearest (ties away)
static __device__ __forceinline__ void round_tf32(uint32_t addr) {
    uint32_t v[4];
    asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v[0]), "=r"(v[1]), "=r"(v[2]), "=r"(v[3]) : "r"(addr) : "memory");
#pragma unroll
    for (int i = 0; i < 4; ++i) asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(v[i]) : "f"(__uint_as_float(v[i])));
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" :: "r"(addr), "r"(v[0]), "r"(v[1]), "r"(v[2]), "r"(v[3])
                 : "memory");
}

// A producer thread's rows of the tile at m0, and its copies of each slot. With TF32 its copies
// into a slot are committed as one group, waited for at its next slot's call (so that two slots'
// copies are in flight), rounded and only then arrived on; finish() does so for the last.
template <class P>
struct Gather {
    int j, r0, at, pix[P::RPT], yx[P::RPT];   // its column, first row, their place in a stage, rows_at's
    uint32_t held = 0;                         // TF32: the shared address of its copies not yet rounded,
    uint64_t* held_bar = nullptr;              // and their slot's barrier

    __device__ __forceinline__ Gather(int tid, int64_t m0, PARAMS) : j(tid % 8), r0(tid / 8) {
        rows_at<P>(m0, M, r0, pix, yx);
        at = r0 * P::BK + (j ^ (r0 & 7)) * 8;
    }

    __device__ __forceinline__ void operator()(uint16_t* as, int k0, uint64_t* bar, PARAMS) {
        gather<P>(P::x(KERNEL_ARGS), as, k0, j, at, pix, yx);
        if constexpr (P::TF32) {
            kiln_cp_async_commit();
            if (held_bar) round_and_arrive<1>();
            held = (uint32_t)__cvta_generic_to_shared(as + at);
            held_bar = bar;
        } else {
            kiln_bar_arrive_cp_async(bar);
        }
    }

    __device__ __forceinline__ void finish() {
        if constexpr (P::TF32) {
            if (held_bar) round_and_arrive<0>();
            held_bar = nullptr;
        }
    }

    // the held copies rounded once all but the last `pending` groups of copies have landed, then arrived on
    template <int pending>
    __device__ __forceinline__ void round_and_arrive() {
        kiln_cp_async_wait<pending>();
#pragma unroll
        for (int i = 0; i < P::RPT; ++i) round_tf32(held + i * 16 * P::BK * 2);
        kiln_bar_arrive(held_bar);
    }
};

}  // namespace kiln::conv_sm90
