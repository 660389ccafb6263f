// The tensor-core step shared by kiln_ops_builtin.templates.matmul_tc and conv_tc: one Bk-deep
// step of a warp's Wm x Wn tile, its fragments read by ldmatrix from XOR-swizzled shared-memory
// tiles and multiplied by mma.sync.m16n8k16 into float32 accumulators.
//
// Needs, ahead of it, the CUDA prelude (kiln_f2h, kiln_f2bf) and the PTX wrappers LDMATRIX
// (kiln_ldmatrix_x4, kiln_ldmatrix_x4_trans, kiln_swz) and MMA (kiln_mma_m16n8k16_f16, _bf16).

namespace kiln::mma_sync {

// A 16-bit float element type: how a float is stored (its 16 bits) and the mma.sync product of
// two fragments of it
struct F16 {
    static __device__ __forceinline__ uint32_t bits(float x) { return (uint32_t)kiln_f2h(x); }
    static __device__ __forceinline__ void mma(float* d, const unsigned* a, const unsigned* b) {
        kiln_mma_m16n8k16_f16(d, a, b);
    }
};

struct BF16 {
    static __device__ __forceinline__ uint32_t bits(float x) { return (uint32_t)kiln_f2bf(x); }
    static __device__ __forceinline__ void mma(float* d, const unsigned* a, const unsigned* b) {
        kiln_mma_m16n8k16_bf16(d, a, b);
    }
};

// acc[Wm / 16][Wn / 8][4] += the warp (wm, wn)'s product of one Bk-deep step of the k-major
// tiles `as` ([Bm][Bk]) and `bs`: [Bn][Bk] k-major where BKContiguous, else [Bk][Bn] row-major
// (read by ldmatrix .trans). Rows hold their 16-byte chunks swizzled by kiln_swz.
template <typename Elem, int Bk, int Bn, int Wm, int Wn, bool BKContiguous>
static __device__ __forceinline__ void step(float (*acc)[Wn / 8][4], const uint16_t* as, const uint16_t* bs, int wm,
                                            int wn, int lane) {
#pragma unroll
    for (int kk = 0; kk < Bk / 16; ++kk) {
        unsigned af[Wm / 16][4], bf[Wn / 8][2];
#pragma unroll
        for (int i = 0; i < Wm / 16; ++i) {
            const int r = wm * Wm + i * 16 + (lane & 15), c = kk * 2 + (lane >> 4);
            kiln_ldmatrix_x4(af[i], as + r * Bk + kiln_swz(r, c, Bk / 8) * 8);
        }
#pragma unroll
        for (int j = 0; j < Wn / 16; ++j) {
            unsigned t[4];
            if constexpr (BKContiguous) {
                const int r = wn * Wn + j * 16 + (lane >> 4) * 8 + (lane & 7), c = kk * 2 + ((lane >> 3) & 1);
                kiln_ldmatrix_x4(t, bs + r * Bk + kiln_swz(r, c, Bk / 8) * 8);
            } else {
                const int r = kk * 16 + (lane & 15), c = (wn * Wn + j * 16) / 8 + (lane >> 4);
                kiln_ldmatrix_x4_trans(t, bs + r * Bn + kiln_swz(r, c, Bn / 8) * 8);
            }
            bf[2 * j][0] = t[0]; bf[2 * j][1] = t[1]; bf[2 * j + 1][0] = t[2]; bf[2 * j + 1][1] = t[3];
        }
#pragma unroll
        for (int i = 0; i < Wm / 16; ++i)
#pragma unroll
            for (int j = 0; j < Wn / 8; ++j)
                Elem::mma(acc[i][j], af[i], bf[j]);
    }
}

}  // namespace kiln::mma_sync
