// split_k's stores where K is not split (SPLIT == 1): the core's epilogue hooks themselves.
// kiln_ops_builtin.templates.split_k's docstring tells when a kernel calls which; split_k.cuh
// holds the same functions where K is split, and a program includes one of the two.
//
// Each store takes the kernel's arguments (KERNEL_ARGS: here the hooks' ARGS), then the split the
// result belongs to (unused here), then the output element (b, m, n). Needs, ahead of it, the
// core's hooks (kiln_epilogue, kiln_epilogue2, kiln_fetch2, kiln_prefetch, kiln_epilogue2_fetched
// and kiln_fetched), PARAMS and ARGS.
static __device__ __forceinline__ void kiln_store(PARAMS, int64_t, int64_t b, int64_t m, int64_t n, float v) {
    kiln_epilogue(ARGS, b, m, n, v);
}

static __device__ __forceinline__ void kiln_store2(PARAMS, int64_t, int64_t b, int64_t m, int64_t n, float v0,
                                                   float v1) {
    kiln_epilogue2(ARGS, b, m, n, v0, v1);
}

static __device__ __forceinline__ void kiln_store2_fetched(PARAMS, int64_t, int64_t b, int64_t m, int64_t n, float v0,
                                                           float v1, const kiln_fetched& f) {
    kiln_epilogue2_fetched(ARGS, b, m, n, v0, v1, f);
}

// What kiln_store2_fetched will read of row m at (b, m, n), into f
static __device__ __forceinline__ void kiln_store_fetch2(PARAMS, int64_t b, int64_t m, int64_t n, kiln_fetched& f) {
    kiln_fetch2(ARGS, b, m, n, f);
}

// What the stores will read of row m at (b, m, n .. n + 31), into L2
static __device__ __forceinline__ void kiln_store_prefetch(PARAMS, int64_t b, int64_t m, int64_t n) {
    kiln_prefetch(ARGS, b, m, n);
}
