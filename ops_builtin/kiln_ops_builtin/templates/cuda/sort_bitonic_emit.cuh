// The last kernel of kiln_ops_builtin.templates.sort_bitonic for rows longer than Tile items:
// every output element, from the sorted rows in the program's items.
//
// Needs, ahead of it, sort_bitonic.cuh and the program's kiln_sort_program (listed there),
// PARAMS and ARGS.

extern "C" __global__ void __launch_bounds__(kiln_sort_program::sort::THREADS) kiln_sort_emit(PARAMS) {
    using P = kiln_sort_program;
    using R = P::rows;
    using S = P::sort;
    for (int64_t e = (int64_t)blockIdx.x * S::THREADS + threadIdx.x; e < R::rows * R::emits;
         e += (int64_t)gridDim.x * S::THREADS)
        S::emit(P::x(ARGS), P::values(ARGS), P::indices(ARGS), P::items(ARGS) + e / R::emits * R::np, e / R::emits,
                e % R::emits);
}
