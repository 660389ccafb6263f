// The float32 SIMT GEMM of kiln_ops_builtin.templates.matmul_simt (its docstring tells the
// algorithm): a block's Bm x Bn tile of out[b][m][n] = sum over k of a(m, k) * b(n, k), on the
// CUDA cores, each result handed to the store functions.
//
// Compile-time knobs: kiln::matmul_simt::Tile<Bm, Bn, Bk, Wm, Wn, Stages, Frag> (matmul_simt.py's
// SimtKnobs: BM is Bm, ...; the lanes' grid and a thread's sub-tile follow from them), and each
// operand's kind: Plain<KC, W, Async> (read from memory: k-contiguous or not, copies of W = 1
// or 4 floats, by cp.async or through registers) or Hooked (read through a load hook, a scalar
// at a time). Run-time problem (kiln::matmul_simt::Problem): M, N, K and the k-tiles each
// blockIdx.y takes (split-K over blocks); blockIdx.z is the batch.
//
// Needs, ahead of it, the CUDA prelude and kiln.template's ptx.CP_ASYNC (kiln_cp_async16,
// kiln_cp_async_commit, kiln_cp_async_wait). Compile-time values are enumerators, not static
// constexpr members (which NVRTC emits as globals).

namespace kiln::matmul_simt {

// The knobs' tile: 256 threads (8 warps of Wm x Wn), the lanes an LM x LN grid over a warp's
// tile (8 x 4 where Wm > Wn, else 4 x 8), each thread a TM x TN sub-tile of 4 x 4 pieces lying
// 4 * LM rows and 4 * LN columns apart; Stages k-tiles of Bk in flight, Frag: a thread's
// fragments double buffered.
template <int Bm, int Bn, int Bk, int Wm, int Wn, int Stages, int Frag>
struct Tile {
    enum : int { BM = Bm, BN = Bn, BK = Bk, WM = Wm, WN = Wn, STAGES = Stages, FRAG = Frag };
    enum : int { LM = Wm > Wn ? 8 : 4, LN = Wm > Wn ? 4 : 8, TM = Wm / LM, TN = Wn / LN };
    enum : int { GROUP_M = 8 };             // tiles go out in groups of GROUP_M rows of tiles (L2 reuse)
};

struct Problem {
    int64_t m, n, k;     // the GEMM's rows, columns and reduction
    int k_tiles;         // Bk-deep k-tiles per blockIdx.y
};

// An operand in memory, as the rendered kernel gives it for batch bz: element (x, k) at
// base[x * xs + k * ks]
struct Operand {
    const float* base;
    int64_t xs, ks;
};

template <int W> struct Vec { typedef float4 type; };
template <> struct Vec<1> { typedef float type; };
static __device__ __forceinline__ float part(float v, int) { return v; }
static __device__ __forceinline__ float part(const float4& v, int e) {
    return e == 0 ? v.x : e == 1 ? v.y : e == 2 ? v.z : v.w;
}
static __device__ __forceinline__ void zero(float& v) { v = 0.f; }
static __device__ __forceinline__ void zero(float4& v) { v = make_float4(0.f, 0.f, 0.f, 0.f); }

// A thread's share of the copies of one operand's k-tile (BX x Bk elements, stored k-major in
// shared memory, rows of BX + 4): L copies of W elements along the operand's contiguous
// dimension (k when KC, else x), copy i starting at tile element `slot(i)`. A k-contiguous
// operand copied as float4s gives each warp 16 rows x 2 float4s of k: whole 32-byte sectors
// of global memory, and transposed stores that the padding keeps free of bank conflicts.
template <int Bk, int BX, int KC, int W>
struct TileCopy {
    enum : int { COPIES = BX * Bk / W, L = (COPIES + 255) / 256 };
    typedef typename Vec<W>::type T;
    T v[L];
    // (x, k) of copy i (a function of threadIdx.x, left to the compiler to keep or recompute)
    static __device__ __forceinline__ int2 slot(int i) {
        const int idx = threadIdx.x + i * 256;
        if constexpr (KC && W == 4) {
            const int c = idx / 32, l = idx % 32;
            return make_int2(l / 2 + 16 * (c / (Bk / 8)), (l % 2 + 2 * (c % (Bk / 8))) * 4);
        } else if constexpr (KC) {
            return make_int2(idx / Bk, idx % Bk);
        } else {
            return make_int2(idx % (BX / W) * W, idx / (BX / W));
        }
    }
    static __device__ __forceinline__ bool live(int i) { return COPIES % 256 == 0 || threadIdx.x + i * 256 < COPIES; }
    // the registers of the last fetch into buffer s
    __device__ __forceinline__ void stash(float (*s)[BX + 4]) const {
#pragma unroll
        for (int i = 0; i < L; ++i) {
            if (!live(i)) continue;
            const int2 at = slot(i);
            if constexpr (!KC && W == 4) {
                *(float4*)&s[at.y][at.x] = v[i];
            } else {
#pragma unroll
                for (int e = 0; e < W; ++e) {
                    if (KC) s[at.y + e][at.x] = part(v[i], e);
                    else s[at.y][at.x + e] = part(v[i], e);
                }
            }
        }
    }
};

// Plain<KC, W, Async>'s copies: element (x, k) at base[x * XS + k * KS], x < X and k < KE. The
// copies' pointers start at the block's first k-tile and advance a k-tile per fetch; `fetch`
// and `async` take the k-tiles in order, k0 being the first k of the one they copy.
template <int Bk, int BX, int KC, int W>
struct PlainCopy : TileCopy<Bk, BX, KC, W> {
    typedef TileCopy<Bk, BX, KC, W> S;
    const float* p[S::L];
    const float* base;
    bool in[S::L];
    int64_t step, ke;
    __device__ __forceinline__ PlainCopy(const float* b, int64_t x0, int64_t X, int64_t XS, int64_t KS, int64_t KE,
                                         int64_t k0) : base(b), step(Bk * KS), ke(KE) {
#pragma unroll
        for (int i = 0; i < S::L; ++i) {
            const int2 at = S::slot(i);
            p[i] = b + (x0 + at.x) * XS + (k0 + at.y) * KS;
            in[i] = x0 + at.x < X;
        }
    }
    // from Plain's operand(bz) (a delegating constructor: a factory returning the copies by value
    // changes the machine code)
    template <typename Of>
    __device__ __forceinline__ PlainCopy(Of operand, int64_t bz, int64_t x0, int64_t X, int64_t KE, int64_t k0)
        : PlainCopy(operand(bz).base, x0, X, operand(bz).xs, operand(bz).ks, KE, k0) {}
    __device__ __forceinline__ void fetch(int64_t k0) {
#pragma unroll
        for (int i = 0; i < S::L; ++i) {
            if (!this->live(i)) continue;
            if (in[i] && k0 + S::slot(i).y < ke) this->v[i] = *(const typename S::T*)p[i];
            else zero(this->v[i]);
            p[i] += step;
        }
    }
    // fetch's copies (W = 4, not KC) straight into buffer s, zero-filled out of bounds
    __device__ __forceinline__ void async(float (*s)[BX + 4], int64_t k0) {
#pragma unroll
        for (int i = 0; i < S::L; ++i) {
            if (!this->live(i)) continue;
            const int2 at = S::slot(i);
            const bool ok = in[i] && k0 + at.y < ke;
            kiln_cp_async16(&s[at.y][at.x], ok ? p[i] : base, ok ? 16 : 0);
            p[i] += step;
        }
    }
};

// Hooked's copies: load(x, k) for x0 + x < X and k < KE, a scalar at a time
template <int Bk, int BX, int KC, class F>
struct HookedCopy : TileCopy<Bk, BX, KC, 1> {
    typedef TileCopy<Bk, BX, KC, 1> S;
    F load;
    int64_t x0, X, ke;
    __device__ __forceinline__ HookedCopy(F f, int64_t, int64_t x0_, int64_t X_, int64_t KE, int64_t)
        : load(f), x0(x0_), X(X_), ke(KE) {}
    __device__ __forceinline__ void fetch(int64_t k0) {
#pragma unroll
        for (int i = 0; i < S::L; ++i) {
            if (!this->live(i)) continue;
            const int2 at = S::slot(i);
            const int64_t gx = x0 + at.x, gk = k0 + at.y;
            this->v[i] = gx < X && gk < ke ? load(gx, gk) : 0.f;
        }
    }
};

// An operand read from memory: k-contiguous (KC) or contiguous along its x (m or n), copied W
// floats at a time (4: aligned float4s along the contiguous dimension), by cp.async where Async
// (W = 4, not KC), else through registers. `operand(bz)` gives the Operand of batch bz.
template <int KC, int W, int Async>
struct Plain {
    enum : int { ASYNC = Async };
    template <int Bk, int BX, int XKC, typename Of> using Copy = PlainCopy<Bk, BX, KC, W>;
};

// An operand read through a load hook, `load(x, k)` a float: its copies walk x (XKC = 0: A,
// neighbouring output pixels) or k (XKC = 1: B, a filter's contiguous taps)
struct Hooked {
    enum : int { ASYNC = 0 };
    template <int Bk, int BX, int XKC, typename F> using Copy = HookedCopy<Bk, BX, XKC, F>;
};

// The block's tile of out: blockIdx.x picks it (in groups of GROUP_M rows of tiles), blockIdx.y
// the split of K, blockIdx.z the batch. As and Bs are the kernel's shared-memory stages (k-major,
// rows padded by 4 floats); problem() gives the Problem, evaluated where a size is read, as a
// macro would be; of_a and of_b are the operands as their kinds A and B take them (Plain: bz ->
// Operand; Hooked: the load hook); store(b, m, n, v) and store2(b, m, n, v0, v1) (n even,
// n + 1 < N) take the results.
template <class T, class A, class B, typename ProblemOf, typename OfA, typename OfB, typename Store, typename Store2>
static __device__ __forceinline__ void run(float (&As)[T::STAGES][T::BK][T::BM + 4],
                                           float (&Bs)[T::STAGES][T::BK][T::BN + 4], ProblemOf problem, OfA of_a,
                                           OfB of_b, Store store, Store2 store2) {
    constexpr int BM = T::BM, BN = T::BN, BK = T::BK, WM = T::WM, WN = T::WN, STAGES = T::STAGES, FRAG = T::FRAG;
    constexpr int LM = T::LM, LN = T::LN, TM = T::TM, TN = T::TN, GROUP_M = T::GROUP_M;
    constexpr bool ASYNC = A::ASYNC || B::ASYNC;
    const int tid = threadIdx.x;
    const int tiles_m = (int)((problem().m + BM - 1) / BM), tiles_n = (int)((problem().n + BN - 1) / BN);
    const int group = blockIdx.x / (GROUP_M * tiles_n), first = group * GROUP_M;
    const int rows = min(tiles_m - first, GROUP_M), r = blockIdx.x % (GROUP_M * tiles_n);
    const int64_t m0 = (int64_t)(first + r % rows) * BM, n0 = (int64_t)(r / rows) * BN;
    const int64_t bz = blockIdx.z;
    const int KT0 = blockIdx.y * problem().k_tiles,
              KT = min((int)((problem().k + BK - 1) / BK) - KT0, problem().k_tiles);
    const int64_t k_first = (int64_t)KT0 * BK;
    typename A::template Copy<BK, BM, 0, OfA> ca(of_a, bz, m0, problem().m, problem().k, k_first);
    typename B::template Copy<BK, BN, 1, OfB> cb(of_b, bz, n0, problem().n, problem().k, k_first);
    // the k-tile whose first k is k0 into stage s: cp.async copies land there (one group a
    // k-tile), the others wait in registers for stash
    auto fetch = [&](int s, int64_t k0) {
        if constexpr (A::ASYNC) ca.async(As[s], k0);
        else ca.fetch(k0);
        if constexpr (B::ASYNC) cb.async(Bs[s], k0);
        else cb.fetch(k0);
    };
    auto stash = [&](int s) {
        if constexpr (!A::ASYNC) ca.stash(As[s]);
        if constexpr (!B::ASYNC) cb.stash(Bs[s]);
    };
    auto commit = [] {
        if constexpr (ASYNC) kiln_cp_async_commit();
    };
    auto landed = [] {
        if constexpr (ASYNC) kiln_cp_async_wait<STAGES - 2>();
    };
    // lanes form an LM x LN grid over the warp's WM x WN tile; a thread's pieces lie 4 * LM
    // rows and 4 * LN columns apart
    const int warp = tid / 32, lane = tid % 32;
    const int wm = warp / (BN / WN) * WM + lane / LN * 4, wn = warp % (BN / WN) * WN + lane % LN * 4;
    float acc[TM][TN];
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j) acc[i][j] = 0.f;
    // k-tiles 0 to STAGES - 2 into their stages; k-tile kt is in stage kt % STAGES
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < KT) {
            fetch(s, (int64_t)(KT0 + s) * BK);
            stash(s);
        }
        commit();
    }
    landed();
    __syncthreads();
    // a thread's fragments of k-step k of stage s into register set f (two sets where FRAG: the
    // next k-step's are read while the current one's FMAs run, across k-tiles too)
    float a[FRAG + 1][TM], b[FRAG + 1][TN];
    auto fragment = [&](int f, int s, int k) {
#pragma unroll
        for (int p = 0; p < TM / 4; ++p) *(float4*)&a[f][p * 4] = *(const float4*)&As[s][k][wm + p * 4 * LM];
#pragma unroll
        for (int p = 0; p < TN / 4; ++p) *(float4*)&b[f][p * 4] = *(const float4*)&Bs[s][k][wn + p * 4 * LN];
    };
    // the end of k-tile kt's reads of shared memory: k-tile kt + STAGES - 1 stashed into the
    // stage kt - 1 left (every thread passed its reads at the last barrier), kt + 1 landed
    auto tile_end = [&](bool ahead, int last) {
        if (ahead) stash(last);
        landed();
        __syncthreads();
    };
    if constexpr (FRAG) fragment(0, 0, 0);
    for (int kt = 0; kt < KT; ++kt) {
        const int cur = kt % STAGES, last = (kt + STAGES - 1) % STAGES;
        const bool ahead = kt + STAGES - 1 < KT;
        if (ahead) fetch(last, (int64_t)(KT0 + (kt + STAGES - 1)) * BK);
        commit();
#pragma unroll
        for (int k = 0; k < BK; ++k) {
            if constexpr (!FRAG) {
                fragment(0, cur, k);
            } else if (k + 1 < BK) {
                fragment((k + 1) % 2, cur, k + 1);
            } else {
                tile_end(ahead, last);
                fragment(0, (kt + 1) % STAGES, 0);
            }
            const int f = FRAG ? k % 2 : 0;
#pragma unroll
            for (int i = 0; i < TM; ++i)
#pragma unroll
                for (int j = 0; j < TN; ++j) acc[i][j] = fmaf(a[f][i], b[f][j], acc[i][j]);
        }
        if constexpr (!FRAG) tile_end(ahead, last);
    }
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < TN; j += 2) {
            const int64_t m = m0 + wm + (i / 4) * 4 * LM + (i % 4);
            const int64_t n = n0 + wn + (j / 4) * 4 * LN + (j % 4);
            if (m < problem().m && n + 1 < problem().n) store2(bz, m, n, acc[i][j], acc[i][j + 1]);
            else if (m < problem().m && n < problem().n) store(bz, m, n, acc[i][j]);
        }
}

}  // namespace kiln::matmul_simt
