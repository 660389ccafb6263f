// The tile step of kiln_ops_builtin.templates.attention_flash (its docstring tells the algorithm),
// shared with attention_decode: copies of padded row tiles, S = Q K^T and O += P V on mma.sync
// with attention_softmax.cuh's online softmax between them, and the merge of partial results
// (of the shares of a split of the keys, or of a CTA's key warps).
//
// Needs, ahead of it, attention.cuh, attention_softmax.cuh, mma_sync.cuh, the PTX wrappers
// CP_ASYNC, LDMATRIX, MMA and CVT_EX2, and the hooks; reads the macros PARAMS, ARGS, LQ, LK and
// K_RS, V_RS (K's and V's row strides, int64s: macros, as the sizes, so that a stride that is a
// number is a literal where it is read; through a function NVRTC orders the code differently),
// and of the program P a kernel names, besides what attention_softmax.cuh reads:
//   D, LDS             the head dim; a shared-memory tile's row: D and 8 elements of padding
//   BN, NT, MT         keys a tile, threads a CTA, 16-row MMA tiles a warp
//   Elem               kiln::mma_sync::F16 or BF16

namespace kiln::attention {

// Two floats as one register of two 16-bit elements of type Elem
template <typename Elem>
struct Pack;

template <>
struct Pack<mma_sync::F16> {
    static __device__ __forceinline__ unsigned pair(float lo, float hi) { return kiln_pack_f16x2(lo, hi); }
};

template <>
struct Pack<mma_sync::BF16> {
    static __device__ __forceinline__ unsigned pair(float lo, float hi) { return kiln_pack_bf16x2(lo, hi); }
};

// Rows rows of a [rows, D] operand from `src` (rows at `stride`) into a padded tile; with Check,
// rows from `valid` on are zero-filled (without, all are in range). Where the threads cover
// whole rows (NT a multiple of D / 8), each copies one column chunk of every STEP-th row from
// a base address of its own, so that its copies differ by constant offsets.
template <typename P, int Rows, bool Check>
static __device__ __forceinline__ void load_rows(uint16_t* dst, const uint16_t* src, int64_t stride, int valid,
                                                 int tid) {
    constexpr int NT = P::NT, LDS = P::LDS, CH = P::D / 8, TOTAL = Rows * CH, STEP = NT / CH;
    if (NT % CH == 0 && Rows % STEP == 0) {
        const int r0 = tid / CH, c = tid % CH;
        const uint16_t* g = src + r0 * stride + c * 8;
        uint16_t* s = dst + r0 * LDS + c * 8;
#pragma unroll
        for (int n = 0; n < Rows / STEP; ++n) {
            if (!Check || r0 + n * STEP < valid) kiln_cp_async16(s + n * STEP * LDS, g + n * STEP * stride, 16);
            else kiln_cp_async16(s + n * STEP * LDS, src, 0);
        }
        return;
    }
#pragma unroll
    for (int n = 0; n < (TOTAL + NT - 1) / NT; ++n) {
        const int idx = tid + n * NT;
        if (TOTAL % NT == 0 || idx < TOTAL) {
            const int r = idx / CH, c = idx % CH;
            const bool ok = !Check || r < valid;
            kiln_cp_async16(dst + r * LDS + c * 8, ok ? src + r * stride + c * 8 : src, ok ? 16 : 0);
        }
    }
}

// Keys n0 .. n0 + Rows of K and V (rows at K_RS, V_RS) into the tiles `ks` and `vs`, rows past LK
// zero-filled.
template <typename P, int Rows>
static __device__ __forceinline__ void load_keys(uint16_t* ks, uint16_t* vs, const uint16_t* K, const uint16_t* V,
                                                 int n0, int tid, PARAMS) {
    if (n0 + Rows <= LK) {
        load_rows<P, Rows, false>(ks, K + n0 * K_RS, K_RS, Rows, tid);
        load_rows<P, Rows, false>(vs, V + n0 * V_RS, V_RS, Rows, tid);
    } else {
        load_rows<P, Rows, true>(ks, K + n0 * K_RS, K_RS, LK - n0, tid);
        load_rows<P, Rows, true>(vs, V + n0 * V_RS, V_RS, LK - n0, tid);
    }
}

// A warp's online-softmax state before its first key: outputs 0, row maxima -inf, sums 0.
template <typename P>
static __device__ __forceinline__ void start_rows(float (&o)[P::MT][P::D / 2], float (&mx)[P::MT][2],
                                                  float (&sum)[P::MT][2]) {
#pragma unroll
    for (int mt = 0; mt < P::MT; ++mt) {
#pragma unroll
        for (int e = 0; e < P::D / 2; ++e) o[mt][e] = 0.f;
        mx[mt][0] = mx[mt][1] = -INFINITY;
        sum[mt][0] = sum[mt][1] = 0.f;
    }
}

// One key tile (keys n0 .. n0 + BN) for a warp's MT * 16 tile rows from row0: S = Q K^T, the
// online softmax (softmax_step), O += P V. Edge: some key of the tile is past LK or (causal)
// after a row.
template <typename P, bool Edge>
static __device__ __forceinline__ void attend(float (&o)[P::MT][P::D / 2], float (&mx)[P::MT][2],
                                              float (&sum)[P::MT][2], const uint16_t* qs, const uint16_t* ks,
                                              const uint16_t* vs, int row0, int n0, int64_t bh, int lane, PARAMS) {
    constexpr int MT = P::MT, D = P::D, BN = P::BN, LDS = P::LDS;
    using Elem = typename P::Elem;
    float s[MT][BN / 2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int e = 0; e < BN / 2; ++e) s[mt][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        unsigned qf[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
            kiln_ldmatrix_x4(qf[mt], qs + (mt * 16 + (lane & 15)) * LDS + (kk * 2 + (lane >> 4)) * 8);
#pragma unroll
        for (int j = 0; j < BN / 16; ++j) {
            unsigned t[4];
            kiln_ldmatrix_x4(t, ks + (j * 16 + (lane >> 4) * 8 + (lane & 7)) * LDS + (kk * 2 + ((lane >> 3) & 1)) * 8);
            const unsigned b0[2] = {t[0], t[1]}, b1[2] = {t[2], t[3]};
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                Elem::mma(&s[mt][8 * j], qf[mt], b0);
                Elem::mma(&s[mt][8 * j + 4], qf[mt], b1);
            }
        }
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        float alpha[2];
        softmax_step<P, Edge, BN / 8>(s[mt], mx[mt], sum[mt], alpha, row0 + mt * 16, n0, bh, lane, ARGS);
        rescale_rows<D / 8>(o[mt], alpha);
    }
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
        unsigned pa[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            pa[mt][0] = Pack<Elem>::pair(s[mt][8 * kk], s[mt][8 * kk + 1]);
            pa[mt][1] = Pack<Elem>::pair(s[mt][8 * kk + 2], s[mt][8 * kk + 3]);
            pa[mt][2] = Pack<Elem>::pair(s[mt][8 * kk + 4], s[mt][8 * kk + 5]);
            pa[mt][3] = Pack<Elem>::pair(s[mt][8 * kk + 6], s[mt][8 * kk + 7]);
        }
#pragma unroll
        for (int j = 0; j < D / 16; ++j) {
            unsigned t[4];
            kiln_ldmatrix_x4_trans(t, vs + (kk * 16 + (lane & 15)) * LDS + (j * 2 + (lane >> 4)) * 8);
            const unsigned b0[2] = {t[0], t[1]}, b1[2] = {t[2], t[3]};
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                Elem::mma(&o[mt][8 * j], pa[mt], b0);
                Elem::mma(&o[mt][8 * j + 4], pa[mt], b1);
            }
        }
    }
}

// The merge of `count` partial results of one row, share s having its maximum and sum at
// stats[s * stats_step] and its unnormalized values n, n + 1 at part[s * part_step]: each
// rescaled to the largest maximum among the shares that saw a key (sum > 0), which goes to
// `top` (-inf where none did), their rescaled sum to `total`; returns the merged values.
static __device__ __forceinline__ float2 merge_shares(int count, const float* stats, int64_t stats_step,
                                                      const float* part, int64_t part_step, float& top, float& total) {
    top = -INFINITY;
    for (int s = 0; s < count; ++s) {
        const float2 st = *(const float2*)&stats[s * stats_step];
        if (st.y > 0.f) top = fmaxf(top, st.x);
    }
    float l = 0.f, o0 = 0.f, o1 = 0.f;
    for (int s = 0; s < count; ++s) {
        const float2 st = *(const float2*)&stats[s * stats_step];
        if (st.y > 0.f) {
            const float f = kiln_ex2(st.x - top);
            const float2 p = *(const float2*)&part[s * part_step];
            l += st.y * f;
            o0 += p.x * f;
            o1 += p.y * f;
        }
    }
    total = l;
    return make_float2(o0, o1);
}

}  // namespace kiln::attention
