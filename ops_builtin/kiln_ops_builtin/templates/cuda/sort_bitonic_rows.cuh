// The kernel of kiln_ops_builtin.templates.sort_bitonic for rows of np <= Tile items: a block
// loads Tile / np rows into shared memory, sorts each there and writes its outputs.
//
// Needs, ahead of it, sort_bitonic.cuh and the program's kiln_sort_program (listed there),
// PARAMS and ARGS.

extern "C" __global__ void __launch_bounds__(kiln_sort_program::sort::THREADS) kiln_sort_rows(PARAMS) {
    using P = kiln_sort_program;
    using R = P::rows;
    using S = P::sort;
    S::item* s = (S::item*)kiln_smem;
    const int64_t row0 = (int64_t)blockIdx.x * (S::TILE / R::np);
    for (int t = threadIdx.x; t < S::TILE; t += S::THREADS)
        s[t] = S::load(P::x(ARGS), row0 + t / R::np, t % R::np);
    __syncthreads();
    S::tile(s, 0, 2, R::np);
    for (int e = threadIdx.x; e < S::TILE / R::np * R::emits; e += S::THREADS) {
        const int64_t row = row0 + e / R::emits;
        if (row < R::rows)
            S::emit(P::x(ARGS), P::values(ARGS), P::indices(ARGS), s + (int64_t)(e / R::emits) * R::np, row,
                    e % R::emits);
    }
}
