// Attention for training on tensor cores (sm_80+), for kiln_ops_builtin.templates.attention_train
// (its docstring tells the design): FlashAttention-2's forward, which also stores each query
// row's natural-log log-sum-exp, and its backward: delta = rowsum(dout * out) (`delta`), then
// dK and dV per key block, looping over the query blocks (`backward_kv`), and dQ per query
// block, looping over the key blocks (`backward_q`), in one launch (`backward`) or two.
// Deterministic: no atomics, every gradient element summed by one thread.
//
// Compile-time: the element type (F16, BF16), the head dim D (K's and V's), causality and the
// knobs (NW warps a CTA, MT 16-row MMA tiles a warp, the tile walked by the loop). Run-time
// (kiln::attn_train::Problem): Lq, Lk, the flattened batch-heads and the softmax scale, so
// that one build serves every size. Inputs and outputs are contiguous [bh][L][D] (lse and
// delta [bh][Lq]), 16-byte aligned.
//
// Every product is mma.sync.m16n8k16 with float32 accumulators. Its fragments, for a lane
// with g = lane / 4 and c = lane % 4: A (16 x 16, row-major) a0 = (g, 2c..2c+1),
// a1 = (g + 8, 2c..), a2 = (g, 2c + 8..), a3 = (g + 8, 2c + 8..); B (16 x 8) b0 = (k 2c..2c+1,
// n g), b1 = (k 2c + 8.., n g); C (16 x 8) c0, c1 = (g, 2c..2c+1), c2, c3 = (g + 8, 2c..).
// An accumulator row block is float[N / 2]: n8 tile j holds elements 4j .. 4j + 3 (c0 .. c3).
// Two products cover every GEMM of the forward and the backward:
// - gemm_abt: acc += A B^T, A and B both row-major [row][k] tiles in shared memory (ldmatrix),
//   for S = Q K^T, S^T = K Q^T, dP = dO V^T and dP^T = V dO^T;
// - gemm_pb: acc += P B, P an accumulator of the first kind rounded to 16 bits in registers
//   (a C fragment's pairs are an A fragment's), B a row-major [k][n] tile (ldmatrix.trans),
//   for O += P V, dV += P^T dO, dK += dS^T Q and dQ += dS K (P^T and dS^T are the
//   accumulators of S^T = K Q^T and dP^T: the key-block kernel takes keys as its rows).
// Shared-memory rows are padded by 16 bytes, so that the eight rows one ldmatrix reads fall in
// distinct bank groups; tiles arrive by 16-byte cp.async copies, zero-filled past the lengths.
//
// Needs the CUDA prelude and the PTX wrappers CP_ASYNC, LDMATRIX, MMA and CVT_EX2 ahead of it.

namespace kiln::attn_train {

// An element type: its mma.sync product and how two floats round to one register of it.
struct F16 {
    static __device__ __forceinline__ void mma(float* d, const unsigned* a, const unsigned* b) {
        kiln_mma_m16n8k16_f16(d, a, b);
    }
    static __device__ __forceinline__ unsigned pack(float lo, float hi) { return kiln_pack_f16x2(lo, hi); }
    static __device__ __forceinline__ float value(uint16_t x) { return kiln_h2f(x); }
};

struct BF16 {
    static __device__ __forceinline__ void mma(float* d, const unsigned* a, const unsigned* b) {
        kiln_mma_m16n8k16_bf16(d, a, b);
    }
    static __device__ __forceinline__ unsigned pack(float lo, float hi) { return kiln_pack_bf16x2(lo, hi); }
    static __device__ __forceinline__ float value(uint16_t x) { return kiln_bf2f(x); }
};

// A bool mask over the scores, read through strides (0 along the dims it broadcasts over): key j
// of query i of batch-head bh is kept where at(bh)[i * si + j * sj] is nonzero, bh being
// (bh / heads, bh % heads) over the two leading dims. Kernels built with MASKED read it; the
// others ignore it (null).
struct Mask {
    const uint8_t* mask;
    int64_t heads, sb, sh, si, sj;
    __device__ __forceinline__ const uint8_t* at(int64_t bh) const {
        return mask + (bh / heads) * sb + (bh % heads) * sh;
    }
};

// The run-time problem: lengths, flattened batch-heads, softmax scale (natural: S = q k^T scale),
// the mask
struct Problem {
    int64_t lq, lk, bh;
    float scale;
    Mask m;
};

static __device__ __forceinline__ float log2e() { return 1.4426950408889634f; }
static __device__ __forceinline__ float ln2() { return 0.6931471805599453f; }

// A row's log-sum-exp in the log2 domain, +inf where the row has no key (lse -inf): then
// every probability exp2(s - lse2) of the row is 0, as the operator defines.
static __device__ __forceinline__ float lse_log2(float lse) { return lse == -INFINITY ? INFINITY : lse * log2e(); }

// The sum and the maximum of a value over the four lanes of a quad (one accumulator row)
static __device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}
static __device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

// Where element e of an accumulator row block lies: its row (0 .. 15) and column in the block
static __device__ __forceinline__ int frag_row(int e, int lane) { return (lane >> 2) + ((e & 2) ? 8 : 0); }
static __device__ __forceinline__ int frag_col(int e, int lane) { return (e >> 2) * 8 + (lane & 3) * 2 + (e & 1); }

// ROWS rows of D elements (contiguous, rows D apart) from `src` into a tile whose rows are
// D + 8 apart, by NT threads; rows from `valid` on are zero-filled. Asynchronous: commit and
// wait (kiln_cp_async_*) before reading the tile.
template <int ROWS, int D, int NT>
static __device__ __forceinline__ void load_rows(uint16_t* dst, const uint16_t* src, int valid, int tid) {
    constexpr int CH = D / 8, TOTAL = ROWS * CH, LDS = D + 8;
#pragma unroll
    for (int n = 0; n < (TOTAL + NT - 1) / NT; ++n) {
        const int idx = tid + n * NT;
        if (TOTAL % NT == 0 || idx < TOTAL) {
            const int r = idx / CH, c = idx % CH;
            const bool ok = r < valid;
            kiln_cp_async16(dst + r * LDS + c * 8, ok ? src + (int64_t)r * D + c * 8 : src, ok ? 16 : 0);
        }
    }
}

template <int MT, int N>
static __device__ __forceinline__ void zero(float (&acc)[MT][N]) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int e = 0; e < N; ++e) acc[mt][e] = 0.f;
}

// acc[MT][N / 2] += A B^T over K: A's MT * 16 rows at `a`, B's N rows at `b`, both [row][k]
// tiles with rows LDS apart (K, N multiples of 16)
template <class E, int MT, int N, int K, int LDS>
static __device__ __forceinline__ void gemm_abt(float (&acc)[MT][N / 2], const uint16_t* a, const uint16_t* b,
                                                int lane) {
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) {
        unsigned af[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)      // a0..a3: rows 0-7 / 8-15 (lanes 0-15), k 0-7 / 8-15 (lanes / 16)
            kiln_ldmatrix_x4(af[mt], a + (mt * 16 + (lane & 15)) * LDS + kk * 16 + (lane >> 4) * 8);
#pragma unroll
        for (int j = 0; j < N / 16; ++j) {
            // b rows n 0-7 (lanes 0-15) or 8-15 (16-31), k 0-7 or 8-15 (lanes 8-15, 24-31):
            // t0, t1 = b0, b1 of n8 tile 2j; t2, t3 those of n8 tile 2j + 1
            unsigned t[4];
            kiln_ldmatrix_x4(t, b + (j * 16 + (lane >> 4) * 8 + (lane & 7)) * LDS + kk * 16 + ((lane >> 3) & 1) * 8);
            const unsigned b0[2] = {t[0], t[1]}, b1[2] = {t[2], t[3]};
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                E::mma(&acc[mt][8 * j], af[mt], b0);
                E::mma(&acc[mt][8 * j + 4], af[mt], b1);
            }
        }
    }
}

// acc[MT][N / 2] += P B: P (MT * 16 x KT) an accumulator row block p[MT][KT / 2], rounded to
// 16 bits here, B's KT rows of N at `b`, a [k][n] tile with rows LDS apart (KT, N multiples of 16)
template <class E, int MT, int KT, int N, int LDS>
static __device__ __forceinline__ void gemm_pb(float (&acc)[MT][N / 2], const float (&p)[MT][KT / 2],
                                               const uint16_t* b, int lane) {
#pragma unroll
    for (int kk = 0; kk < KT / 16; ++kk) {
        unsigned pa[MT][4];       // the C fragments of n8 tiles 2kk and 2kk + 1 are A's k 0-7 and 8-15
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            pa[mt][0] = E::pack(p[mt][8 * kk], p[mt][8 * kk + 1]);
            pa[mt][1] = E::pack(p[mt][8 * kk + 2], p[mt][8 * kk + 3]);
            pa[mt][2] = E::pack(p[mt][8 * kk + 4], p[mt][8 * kk + 5]);
            pa[mt][3] = E::pack(p[mt][8 * kk + 6], p[mt][8 * kk + 7]);
        }
#pragma unroll
        for (int j = 0; j < N / 16; ++j) {
            // transposed 8 x 8 blocks: k 0-7 / 8-15 (lanes 0-7, 8-15), n 0-7 / 8-15 (lanes / 16):
            // t0, t1 = b0, b1 of n8 tile 2j; t2, t3 those of n8 tile 2j + 1
            unsigned t[4];
            kiln_ldmatrix_x4_trans(t, b + (kk * 16 + (lane & 15)) * LDS + j * 16 + (lane >> 4) * 8);
            const unsigned b0[2] = {t[0], t[1]}, b1[2] = {t[2], t[3]};
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                E::mma(&acc[mt][8 * j], pa[mt], b0);
                E::mma(&acc[mt][8 * j + 4], pa[mt], b1);
            }
        }
    }
}

// Rows `row0 + 0 .. MT * 16` of an accumulator row block (N = D columns) times `factor`, rounded
// to 16 bits, into the [rows][D] tensor `dst`, rows from `rows` on left out.
template <class E, int MT, int D>
static __device__ __forceinline__ void store_rows(uint16_t* dst, const float (&acc)[MT][D / 2], int row0, int rows,
                                                  float factor, int lane) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = row0 + mt * 16 + (lane >> 2) + h * 8;
            if (row >= rows) continue;
#pragma unroll
            for (int j = 0; j < D / 8; ++j)
                *(unsigned*)(dst + (int64_t)row * D + j * 8 + (lane & 3) * 2) =
                    E::pack(acc[mt][4 * j + 2 * h] * factor, acc[mt][4 * j + 2 * h + 1] * factor);
        }
}

// The online softmax over one key tile of a warp's rows (from row0; keys from n0): S (the
// accumulators `s`) scaled to the log2 domain, with MASK the keys past Lk, (causal) after the
// row or (MASKED) dropped by the mask `m` (this batch-head's) dropped; each row's maximum `mx`
// and sum `sum` updated, its outputs `o` rescaled to the new maximum, and `s` made the tile's
// probabilities relative to it.
template <int MT, int BN, int D, bool MASK, bool CAUSAL, bool MASKED>
static __device__ __forceinline__ void softmax_tile(float (&s)[MT][BN / 2], float (&o)[MT][D / 2], float (&mx)[MT][2],
                                                    float (&sum)[MT][2], int row0, int n0, int lq, int lk,
                                                    const uint8_t* m, const Mask& mask, float scale2, int lane) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = row0 + mt * 16 + (lane >> 2) + h * 8;
            const int limit = row >= lq && MASKED ? 0 : CAUSAL ? min(lk, row + 1) : lk;  // keys n0 + col < limit count
            float top = -INFINITY;
#pragma unroll
            for (int j = 0; j < BN / 8; ++j)
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const int e = 4 * j + 2 * h + c, key = n0 + frag_col(e, lane);
                    const bool keep = !MASK || (key < limit && (!MASKED || m[row * mask.si + key * mask.sj]));
                    const float x = keep ? s[mt][e] * scale2 : -INFINITY;
                    s[mt][e] = x;
                    top = fmaxf(top, x);
                }
            const float high = fmaxf(mx[mt][h], quad_max(top));
            const float shift = high == -INFINITY ? 0.f : high;       // no key yet: every exp2 is 0
            const float alpha = kiln_ex2(mx[mt][h] - shift);
            mx[mt][h] = high;
            float part = 0.f;
#pragma unroll
            for (int j = 0; j < BN / 8; ++j)
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const int e = 4 * j + 2 * h + c;
                    s[mt][e] = kiln_ex2(s[mt][e] - shift);
                    part += s[mt][e];
                }
            sum[mt][h] = sum[mt][h] * alpha + part;
#pragma unroll
            for (int j = 0; j < D / 8; ++j) {
                o[mt][4 * j + 2 * h] *= alpha;
                o[mt][4 * j + 2 * h + 1] *= alpha;
            }
        }
}

// ---------------------------------------------------------------------------------------- forward
// A CTA owns BM = NW * MT * 16 queries of one batch-head (blockIdx.x: query block, then
// batch-head; causal blocks in reverse, the longest first), each warp MT * 16 of them. Keys
// stream BN at a time through two shared-memory stages, the next tile's copies in flight while
// the current one is multiplied. Per tile: S = Q K^T, scaled to the log2 domain and masked
// (keys past Lk; causal: keys after the row), the online softmax (row maximum and sum), O += P V.
// At the end O / sum goes to `out`, (max + log2(sum)) ln 2 to `lse` (-inf and zeros for a row
// with no key).
template <class E, int D, int NW, int MT, int BN, bool CAUSAL, bool MASKED>
static __device__ __forceinline__ void forward(const uint16_t* q, const uint16_t* k, const uint16_t* v, uint16_t* out,
                                               float* lse, const Problem& p, unsigned char* smem) {
    constexpr int NT = NW * 32, BM = NW * MT * 16, LDS = D + 8;
    static_assert(D % 16 == 0 && BN % 16 == 0, "head dim and key tile: multiples of 16");
    uint16_t* Qs = (uint16_t*)smem;
    uint16_t* Ks = Qs + BM * LDS;
    uint16_t* Vs = Ks + 2 * BN * LDS;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int lq = (int)p.lq, lk = (int)p.lk;
    const int64_t m_blocks = (p.lq + BM - 1) / BM, bh = blockIdx.x / m_blocks;
    const int block = (int)(blockIdx.x % m_blocks), mb = CAUSAL ? (int)m_blocks - 1 - block : block;
    const int m0 = mb * BM, row0 = m0 + warp * MT * 16;
    q += bh * p.lq * D;
    k += bh * p.lk * D;
    v += bh * p.lk * D;
    out += bh * p.lq * D;
    lse += bh * p.lq;
    const uint8_t* m = MASKED ? p.m.at(bh) : nullptr;
    const int keys = CAUSAL ? min(lk, m0 + BM) : lk, tiles = (keys + BN - 1) / BN;
    load_rows<BM, D, NT>(Qs, q + (int64_t)m0 * D, lq - m0, tid);
    auto load_keys = [&](int stage, int n0) {
        load_rows<BN, D, NT>(Ks + stage * BN * LDS, k + (int64_t)n0 * D, lk - n0, tid);
        load_rows<BN, D, NT>(Vs + stage * BN * LDS, v + (int64_t)n0 * D, lk - n0, tid);
    };
    load_keys(0, 0);
    kiln_cp_async_commit();
    const float scale2 = p.scale * log2e();
    float o[MT][D / 2], mx[MT][2], sum[MT][2];
    zero(o);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) mx[mt][0] = mx[mt][1] = -INFINITY, sum[mt][0] = sum[mt][1] = 0.f;
    for (int t = 0; t < tiles; ++t) {
        if (t + 1 < tiles) load_keys((t + 1) & 1, (t + 1) * BN);
        kiln_cp_async_commit();
        kiln_cp_async_wait<1>();
        __syncthreads();
        const int n0 = t * BN;
        const uint16_t* ks = Ks + (t & 1) * BN * LDS;
        const uint16_t* vs = Vs + (t & 1) * BN * LDS;
        if (row0 < lq && (!CAUSAL || n0 <= row0 + MT * 16 - 1)) {
            float s[MT][BN / 2];
            zero(s);
            gemm_abt<E, MT, BN, D, LDS>(s, Qs + warp * MT * 16 * LDS, ks, lane);
            // only tiles with a key past Lk or (causal) after a row of the warp need the edge
            // test (every tile, with a mask)
            if (MASKED || n0 + BN > lk || (CAUSAL && n0 + BN - 1 > row0))
                softmax_tile<MT, BN, D, true, CAUSAL, MASKED>(s, o, mx, sum, row0, n0, lq, lk, m, p.m, scale2, lane);
            else
                softmax_tile<MT, BN, D, false, CAUSAL, MASKED>(s, o, mx, sum, row0, n0, lq, lk, m, p.m, scale2, lane);
            gemm_pb<E, MT, BN, D, LDS>(o, s, vs, lane);
        }
        __syncthreads();
    }
    kiln_cp_async_wait<0>();
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = row0 + mt * 16 + (lane >> 2) + h * 8;
            const float total = quad_sum(sum[mt][h]);
            if (row >= lq) continue;
            const float inv = total == 0.f ? 0.f : 1.f / total;
#pragma unroll
            for (int j = 0; j < D / 8; ++j)
                *(unsigned*)(out + (int64_t)row * D + j * 8 + (lane & 3) * 2) =
                    E::pack(o[mt][4 * j + 2 * h] * inv, o[mt][4 * j + 2 * h + 1] * inv);
            if ((lane & 3) == 0) lse[row] = total == 0.f ? -INFINITY : (mx[mt][h] + log2f(total)) * ln2();
        }
}

// ---------------------------------------------------------------------------------------- delta
// delta[r] = sum over d of dout[r][d] * out[r][d] in float32, for rows r < rows: D / 8 lanes a
// row (16 bytes each), rows grid-strided by whole warps (the shuffles need every lane).
template <class E, int D, int NT>
static __device__ __forceinline__ void delta(const uint16_t* dout, const uint16_t* out, float* dl, int64_t rows) {
    constexpr int CH = D / 8, PER_WARP = 32 / CH;
    static_assert(32 % CH == 0, "D / 8 lanes a row must divide a warp");
    const int lane = threadIdx.x & 31;
    const int64_t warps = (int64_t)gridDim.x * (NT / 32);
    for (int64_t w = (int64_t)blockIdx.x * (NT / 32) + threadIdx.x / 32; w * PER_WARP < rows; w += warps) {
        const int64_t r = w * PER_WARP + lane / CH;
        const int c = lane % CH;
        float acc = 0.f;
        if (r < rows) {
            const uint4 a = *(const uint4*)(dout + r * D + c * 8), b = *(const uint4*)(out + r * D + c * 8);
            const unsigned wa[4] = {a.x, a.y, a.z, a.w}, wb[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
            for (int i = 0; i < 4; ++i)
                acc += E::value((uint16_t)(wa[i] & 0xffffu)) * E::value((uint16_t)(wb[i] & 0xffffu))
                     + E::value((uint16_t)(wa[i] >> 16)) * E::value((uint16_t)(wb[i] >> 16));
        }
#pragma unroll
        for (int s = CH / 2; s > 0; s /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, s);
        if (r < rows && c == 0) dl[r] = acc;
    }
}

// P^T of the dK/dV kernel: S^T (`s`, rows the keys from key0, columns the queries from m0)
// to exp2(S^T scale log2 e - lse2 of the query), with MASK 0 where the causal mask drops the
// key (j > i), the query is past Lq or (MASKED) the mask `m` drops the key (keys past Lk too).
template <int MT, int BQ, bool MASK, bool CAUSAL, bool MASKED>
static __device__ __forceinline__ void key_probabilities(float (&s)[MT][BQ / 2], const float* ls, int key0, int m0,
                                                         int lq, int lk, const uint8_t* m, const Mask& mask,
                                                         float scale2, int lane) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int e = 0; e < BQ / 2; ++e) {
            const int j = key0 + mt * 16 + frag_row(e, lane), c = frag_col(e, lane), i = m0 + c;
            const bool keep = !MASK || (i < lq && (!CAUSAL || j <= i)
                                        && (!MASKED || (j < lk && m[i * mask.si + j * mask.sj])));
            s[mt][e] = keep ? kiln_ex2(s[mt][e] * scale2 - ls[c]) : 0.f;
        }
}

// P of the dQ kernel: S (`s`, rows a warp's queries from row0, columns the keys from n0) to
// exp2(S scale log2 e - lse2 of the row), with MASK 0 for the keys from the row's `limit` on
// (past Lk, or after the row where causal; 0 for rows past Lq) or (MASKED) dropped by `m`.
template <int MT, int BN, bool MASK, bool MASKED>
static __device__ __forceinline__ void query_probabilities(float (&s)[MT][BN / 2], const float (&l2)[MT][2],
                                                           const int (&limit)[MT][2], int row0, int n0,
                                                           const uint8_t* m, const Mask& mask, float scale2,
                                                           int lane) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int e = 0; e < BN / 2; ++e) {
            const int h = (e >> 1) & 1, key = n0 + frag_col(e, lane);
            const int row = row0 + mt * 16 + frag_row(e, lane);
            const bool keep = !MASK || (key < limit[mt][h] && (!MASKED || m[row * mask.si + key * mask.sj]));
            s[mt][e] = keep ? kiln_ex2(s[mt][e] * scale2 - l2[mt][h]) : 0.f;
        }
}

// ---------------------------------------------------------------------------------------- dK, dV
// A CTA owns BKV = NW * MT * 16 keys of one batch-head (`cta`: key block, then batch-head),
// each warp MT * 16 of them as its rows, K and V in shared memory for the whole loop. Queries
// stream BQ at a time (Q, dO, lse in the log2 domain, delta; two stages), from the first block
// that a causal mask leaves a key of the CTA. Per query tile, for a warp's keys j and the
// tile's queries i: S^T = K Q^T; P^T = exp2(S^T scale log2 e - lse2_i), 0 where the key is
// dropped (causal j > i) or i >= Lq; dV += P^T dO; dP^T = V dO^T; dS^T = P^T (dP^T - delta_i);
// dK += dS^T Q. At the end dK * scale and dV go out, rounded once.
template <class E, int D, int NW, int MT, int BQ, bool CAUSAL, bool MASKED>
static __device__ __forceinline__ void backward_kv(const uint16_t* dout, const uint16_t* q, const uint16_t* k,
                                                   const uint16_t* v, const float* lse, const float* dl, uint16_t* dk,
                                                   uint16_t* dv, const Problem& p, unsigned char* smem,
                                                   int64_t cta) {
    constexpr int NT = NW * 32, BKV = NW * MT * 16, LDS = D + 8;
    static_assert(D % 16 == 0 && BQ % 16 == 0, "head dim and query tile: multiples of 16");
    uint16_t* Ks = (uint16_t*)smem;
    uint16_t* Vs = Ks + BKV * LDS;
    uint16_t* Qs = Vs + BKV * LDS;           // two stages of BQ rows
    uint16_t* dOs = Qs + 2 * BQ * LDS;       // two stages of BQ rows
    float* Ls = (float*)(dOs + 2 * BQ * LDS);  // two stages of BQ lse2
    float* Ds = Ls + 2 * BQ;                 // two stages of BQ delta
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int lq = (int)p.lq, lk = (int)p.lk;
    const int64_t n_blocks = (p.lk + BKV - 1) / BKV, bh = cta / n_blocks;
    const int n0 = (int)(cta % n_blocks) * BKV, key0 = n0 + warp * MT * 16;
    dout += bh * p.lq * D;
    q += bh * p.lq * D;
    k += bh * p.lk * D;
    v += bh * p.lk * D;
    dk += bh * p.lk * D;
    dv += bh * p.lk * D;
    lse += bh * p.lq;
    dl += bh * p.lq;
    const uint8_t* m = MASKED ? p.m.at(bh) : nullptr;
    load_rows<BKV, D, NT>(Ks, k + (int64_t)n0 * D, lk - n0, tid);
    load_rows<BKV, D, NT>(Vs, v + (int64_t)n0 * D, lk - n0, tid);
    const int first = CAUSAL ? n0 / BQ : 0, tiles = (lq + BQ - 1) / BQ;
    static_assert(BQ <= NT, "a thread loads one query's lse and delta");
    // the copies of the query tile from m0 into `stage`; its lse2 and delta to registers, which
    // go to shared memory after the current tile's math (their loads' latency hidden by it)
    float lse_next = INFINITY, delta_next = 0.f;
    auto load_queries = [&](int stage, int m0) {
        load_rows<BQ, D, NT>(Qs + stage * BQ * LDS, q + (int64_t)m0 * D, lq - m0, tid);
        load_rows<BQ, D, NT>(dOs + stage * BQ * LDS, dout + (int64_t)m0 * D, lq - m0, tid);
        const bool ok = tid < BQ && m0 + tid < lq;
        lse_next = ok ? lse_log2(lse[m0 + tid]) : INFINITY;
        delta_next = ok ? dl[m0 + tid] : 0.f;
    };
    auto keep_queries = [&](int stage) {
        if (tid < BQ) {
            Ls[stage * BQ + tid] = lse_next;
            Ds[stage * BQ + tid] = delta_next;
        }
    };
    if (first < tiles) {
        load_queries(0, first * BQ);
        keep_queries(0);
    }
    kiln_cp_async_commit();
    const float scale2 = p.scale * log2e();
    float dka[MT][D / 2], dva[MT][D / 2];
    zero(dka);
    zero(dva);
    const uint16_t* kw = Ks + warp * MT * 16 * LDS;
    const uint16_t* vw = Vs + warp * MT * 16 * LDS;
    for (int t = first; t < tiles; ++t) {
        const int stage = (t - first) & 1;
        if (t + 1 < tiles) load_queries(stage ^ 1, (t + 1) * BQ);
        kiln_cp_async_commit();
        kiln_cp_async_wait<1>();
        __syncthreads();
        const int m0 = t * BQ;
        const uint16_t* qs = Qs + stage * BQ * LDS;
        const uint16_t* dos = dOs + stage * BQ * LDS;
        const float* ls = Ls + stage * BQ;
        const float* ds = Ds + stage * BQ;
        if (key0 < lk && (!CAUSAL || m0 + BQ - 1 >= key0)) {
            float s[MT][BQ / 2];
            zero(s);
            gemm_abt<E, MT, BQ, D, LDS>(s, kw, qs, lane);              // S^T = K Q^T
            // queries past Lq have lse2 +inf (probability 0); only the causal mask needs a test,
            // on tiles where some query precedes some key of the warp (every tile, with a mask)
            if (MASKED || (CAUSAL && m0 < key0 + MT * 16 - 1))
                key_probabilities<MT, BQ, true, CAUSAL, MASKED>(s, ls, key0, m0, lq, lk, m, p.m, scale2, lane);
            else
                key_probabilities<MT, BQ, false, CAUSAL, MASKED>(s, ls, key0, m0, lq, lk, m, p.m, scale2, lane);
            gemm_pb<E, MT, BQ, D, LDS>(dva, s, dos, lane);              // dV += P^T dO
            float dp[MT][BQ / 2];
            zero(dp);
            gemm_abt<E, MT, BQ, D, LDS>(dp, vw, dos, lane);             // dP^T = V dO^T
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int e = 0; e < BQ / 2; ++e) dp[mt][e] = s[mt][e] * (dp[mt][e] - ds[frag_col(e, lane)]);
            gemm_pb<E, MT, BQ, D, LDS>(dka, dp, qs, lane);              // dK += dS^T Q
        }
        if (t + 1 < tiles) keep_queries(stage ^ 1);        // read from the next iteration on
        __syncthreads();
    }
    kiln_cp_async_wait<0>();
    store_rows<E, MT, D>(dk, dka, key0, lk, p.scale, lane);
    store_rows<E, MT, D>(dv, dva, key0, lk, 1.f, lane);
}

// ---------------------------------------------------------------------------------------- dQ
// A CTA owns BM = NW * MT * 16 queries of one batch-head (`cta`: query block, then batch-head;
// causal blocks in reverse), each warp MT * 16 of them, Q and dO in shared memory
// for the whole loop, each row's lse2 and delta in registers. Keys stream BN at a time (K and
// V, two stages), up to the last a causal mask keeps. Per key tile: S = Q K^T;
// P = exp2(S scale log2 e - lse2), 0 where the key is past Lk or (causal) after the row;
// dP = dO V^T; dS = P (dP - delta); dQ += dS K. At the end dQ * scale goes out.
template <class E, int D, int NW, int MT, int BN, bool CAUSAL, bool MASKED>
static __device__ __forceinline__ void backward_q(const uint16_t* dout, const uint16_t* q, const uint16_t* k,
                                                  const uint16_t* v, const float* lse, const float* dl, uint16_t* dq,
                                                  const Problem& p, unsigned char* smem, int64_t cta) {
    constexpr int NT = NW * 32, BM = NW * MT * 16, LDS = D + 8;
    static_assert(D % 16 == 0 && BN % 16 == 0, "head dim and key tile: multiples of 16");
    uint16_t* Qs = (uint16_t*)smem;
    uint16_t* dOs = Qs + BM * LDS;
    uint16_t* Ks = dOs + BM * LDS;           // two stages of BN rows
    uint16_t* Vs = Ks + 2 * BN * LDS;        // two stages of BN rows
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int lq = (int)p.lq, lk = (int)p.lk;
    const int64_t m_blocks = (p.lq + BM - 1) / BM, bh = cta / m_blocks;
    const int block = (int)(cta % m_blocks), mb = CAUSAL ? (int)m_blocks - 1 - block : block;
    const int m0 = mb * BM, row0 = m0 + warp * MT * 16;
    dout += bh * p.lq * D;
    q += bh * p.lq * D;
    k += bh * p.lk * D;
    v += bh * p.lk * D;
    dq += bh * p.lq * D;
    lse += bh * p.lq;
    dl += bh * p.lq;
    const uint8_t* m = MASKED ? p.m.at(bh) : nullptr;
    load_rows<BM, D, NT>(Qs, q + (int64_t)m0 * D, lq - m0, tid);
    load_rows<BM, D, NT>(dOs, dout + (int64_t)m0 * D, lq - m0, tid);
    const int keys = CAUSAL ? min(lk, m0 + BM) : lk, tiles = (keys + BN - 1) / BN;
    auto load_keys = [&](int stage, int n0) {
        load_rows<BN, D, NT>(Ks + stage * BN * LDS, k + (int64_t)n0 * D, lk - n0, tid);
        load_rows<BN, D, NT>(Vs + stage * BN * LDS, v + (int64_t)n0 * D, lk - n0, tid);
    };
    load_keys(0, 0);
    kiln_cp_async_commit();
    const float scale2 = p.scale * log2e();
    float l2[MT][2], dlt[MT][2];
    int limit[MT][2];                        // a row's keys: n < limit
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = row0 + mt * 16 + (lane >> 2) + h * 8;
            l2[mt][h] = row < lq ? lse_log2(lse[row]) : INFINITY;
            dlt[mt][h] = row < lq ? dl[row] : 0.f;
            limit[mt][h] = row >= lq ? 0 : CAUSAL ? min(lk, row + 1) : lk;
        }
    float dqa[MT][D / 2];
    zero(dqa);
    const uint16_t* qw = Qs + warp * MT * 16 * LDS;
    const uint16_t* dow = dOs + warp * MT * 16 * LDS;
    for (int t = 0; t < tiles; ++t) {
        if (t + 1 < tiles) load_keys((t + 1) & 1, (t + 1) * BN);
        kiln_cp_async_commit();
        kiln_cp_async_wait<1>();
        __syncthreads();
        const int n0 = t * BN;
        const uint16_t* ks = Ks + (t & 1) * BN * LDS;
        const uint16_t* vs = Vs + (t & 1) * BN * LDS;
        if (row0 < lq && (!CAUSAL || n0 <= row0 + MT * 16 - 1)) {
            float s[MT][BN / 2];
            zero(s);
            gemm_abt<E, MT, BN, D, LDS>(s, qw, ks, lane);               // S = Q K^T
            // rows past Lq have lse2 +inf (probability 0); keys past Lk and the causal mask need a
            // test only on the tiles that hold such keys for some row of the warp (every tile,
            // with a mask)
            if (MASKED || n0 + BN > lk || (CAUSAL && n0 + BN - 1 > row0))
                query_probabilities<MT, BN, true, MASKED>(s, l2, limit, row0, n0, m, p.m, scale2, lane);
            else
                query_probabilities<MT, BN, false, MASKED>(s, l2, limit, row0, n0, m, p.m, scale2, lane);
            float dp[MT][BN / 2];
            zero(dp);
            gemm_abt<E, MT, BN, D, LDS>(dp, dow, vs, lane);             // dP = dO V^T
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int e = 0; e < BN / 2; ++e) dp[mt][e] = s[mt][e] * (dp[mt][e] - dlt[mt][(e >> 1) & 1]);
            gemm_pb<E, MT, BN, D, LDS>(dqa, dp, ks, lane);              // dQ += dS K
        }
        __syncthreads();
    }
    kiln_cp_async_wait<0>();
    store_rows<E, MT, D>(dq, dqa, row0, lq, p.scale, lane);
}

// ---------------------------------------------------------------------------------------- backward
// Both backward kernels as one launch (after `delta`'s): the first ceil(Lk / BKV) * bh CTAs
// compute dK and dV (backward_kv), the others dQ (backward_q), so that the dQ blocks fill the
// tail of the dK/dV blocks' last wave. Shared memory: backward_kv's (the larger).
template <class E, int D, int NW, int MT, int BN, bool CAUSAL, bool MASKED>
static __device__ __forceinline__ void backward(const uint16_t* dout, const uint16_t* q, const uint16_t* k,
                                                const uint16_t* v, const float* lse, const float* dl, uint16_t* dq,
                                                uint16_t* dk, uint16_t* dv, const Problem& p, unsigned char* smem) {
    constexpr int ROWS = NW * MT * 16;
    const int64_t kv_ctas = (p.lk + ROWS - 1) / ROWS * p.bh;
    if ((int64_t)blockIdx.x < kv_ctas)
        backward_kv<E, D, NW, MT, BN, CAUSAL, MASKED>(dout, q, k, v, lse, dl, dk, dv, p, smem, blockIdx.x);
    else
        backward_q<E, D, NW, MT, BN, CAUSAL, MASKED>(dout, q, k, v, lse, dl, dq, p, smem, blockIdx.x - kv_ctas);
}

}  // namespace kiln::attn_train
