// split_k's stores where K is split (SPLIT > 1): each result goes, as a float32 partial, to the
// workspace kiln_ws[SPLIT][BATCH][M][N] (a kernel parameter: PARAMS ends with it), which
// split_k_sum.cuh's kernel then adds up and hands to the core's epilogue hooks. The functions are
// split_k_direct.cuh's, for a program whose K is split; a program includes one of the two.
//
// Each store takes the kernel's arguments (KERNEL_ARGS: the hooks' ARGS, then kiln_ws), then the
// split the result belongs to (of the kernel's own integer type: blockIdx.y, a loop's int; widened
// here, where the address is computed), then the output element (b, m, n). Needs, ahead of it, the
// program's kiln_split_k_program (split_k.py renders it):
//   SPLIT, FLOAT2_PAIRS     the splits; whether a pair of results stores as one float2 (N even)
// and split_k's BATCH, M, N (run-time where symbolic), the core's kiln_fetched, PARAMS.
template <class Split>
static __device__ __forceinline__ float* kiln_partial(PARAMS, Split split, int64_t b, int64_t m, int64_t n) {
    return &kiln_ws[((int64_t)split * BATCH + b) * ((int64_t)M * N) + m * (int64_t)N + n];
}

template <class Split>
static __device__ __forceinline__ void kiln_store(PARAMS, Split split, int64_t b, int64_t m, int64_t n, float v) {
    *kiln_partial(KERNEL_ARGS, split, b, m, n) = v;
}

// results (b, m, n) and (b, m, n + 1), n + 1 < N
template <class Split>
static __device__ __forceinline__ void kiln_store2(PARAMS, Split split, int64_t b, int64_t m, int64_t n, float v0,
                                                   float v1) {
    float* p = kiln_partial(KERNEL_ARGS, split, b, m, n);
    if constexpr (kiln_split_k_program::FLOAT2_PAIRS) {
        *(float2*)p = make_float2(v0, v1);
    } else {
        p[0] = v0;
        p[1] = v1;
    }
}

// the epilogue runs in the sum kernel: nothing to fetch or prefetch for it here
template <class Split>
static __device__ __forceinline__ void kiln_store2_fetched(PARAMS, Split split, int64_t b, int64_t m, int64_t n,
                                                           float v0, float v1, const kiln_fetched&) {
    kiln_store2(KERNEL_ARGS, split, b, m, n, v0, v1);
}

static __device__ __forceinline__ void kiln_store_fetch2(PARAMS, int64_t, int64_t, int64_t, kiln_fetched&) {}

static __device__ __forceinline__ void kiln_store_prefetch(PARAMS, int64_t, int64_t, int64_t) {}
