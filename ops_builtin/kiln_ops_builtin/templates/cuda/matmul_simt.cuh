// The float32 SIMT GEMM of kiln_ops_builtin.templates.matmul_simt (its docstring tells the
// algorithm): a block's Bm x Bn tile of out[b][m][n] = sum over k of a(m, k) * b(n, k), on the
// CUDA cores: the pieces of the kernel in matmul_simt_kernel.cuh.
//
// Compile-time knobs: kiln::matmul_simt::Tile<Bm, Bn, Bk, Wm, Wn, MinBlocks, Stages, Frag>
// (matmul_simt.py's SimtKnobs: BM is Bm, ...; the lanes' grid and a thread's sub-tile follow from
// them), and each operand's kind: Plain<KC, W, Async> (read from memory: k-contiguous or not,
// copies of W = 1 or 4 floats, by cp.async or through registers) or Hooked (read through a load
// hook, a scalar at a time).
//
// Needs, ahead of it, the CUDA prelude and kiln.template's ptx.CP_ASYNC (kiln_cp_async16,
// kiln_cp_async_commit, kiln_cp_async_wait). Compile-time values are enumerators, not static
// constexpr members (which NVRTC emits as globals).

namespace kiln::matmul_simt {

// The knobs' tile: 256 threads (8 warps of Wm x Wn), the lanes an LM x LN grid over a warp's
// tile (8 x 4 where Wm > Wn, else 4 x 8), each thread a TM x TN sub-tile of 4 x 4 pieces lying
// 4 * LM rows and 4 * LN columns apart; Stages k-tiles of Bk in flight, Frag: a thread's
// fragments double buffered; MinBlocks blocks an SM (__launch_bounds__).
template <int Bm, int Bn, int Bk, int Wm, int Wn, int MinBlocks, int Stages, int Frag>
struct Tile {
    enum : int { BM = Bm, BN = Bn, BK = Bk, WM = Wm, WN = Wn, MIN_BLOCKS = MinBlocks, STAGES = Stages, FRAG = Frag };
    enum : int { LM = Wm > Wn ? 8 : 4, LN = Wm > Wn ? 4 : 8, TM = Wm / LM, TN = Wn / LN };
    enum : int { GROUP_M = 8 };             // tiles go out in groups of GROUP_M rows of tiles (L2 reuse)
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
    // never called (Hooked is not ASYNC); the kernel, no template, names it in a discarded branch
    __device__ __forceinline__ void async(float (*)[BX + 4], int64_t) {}
};

// An operand read from memory: k-contiguous (KC) or contiguous along its x (m or n), copied W
// floats at a time (4: aligned float4s along the contiguous dimension), by cp.async where Async
// (W = 4, not KC), else through registers. `operand(bz)` (Copy's Of) gives the Operand of batch bz.
template <int KC, int W, int Async>
struct Plain {
    enum : int { ASYNC = Async };
    template <int Bk, int BX, int XKC, typename Of> using Copy = PlainCopy<Bk, BX, KC, W>;
};

// An operand read through a load hook, `load(x, k)` a float (Copy's F): its copies walk x (XKC = 0: A,
// neighbouring output pixels) or k (XKC = 1: B, a filter's contiguous taps)
struct Hooked {
    enum : int { ASYNC = 0 };
    template <int Bk, int BX, int XKC, typename F> using Copy = HookedCopy<Bk, BX, XKC, F>;
};

// cp.async's group of a k-tile's copies, and the wait for all but the last Stages - 2 groups
// (nothing where no operand comes by cp.async)
template <bool Async>
static __device__ __forceinline__ void commit() {
    if constexpr (Async) kiln_cp_async_commit();
}

template <bool Async, int Stages>
static __device__ __forceinline__ void landed() {
    if constexpr (Async) kiln_cp_async_wait<Stages - 2>();
}

}  // namespace kiln::matmul_simt
