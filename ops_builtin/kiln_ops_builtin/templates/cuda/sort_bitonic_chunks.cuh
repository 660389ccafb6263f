// The first kernel of kiln_ops_builtin.templates.sort_bitonic for rows longer than Tile items:
// block b sorts chunk b % (np / Tile) of row b / (np / Tile) in shared memory, in the direction
// of the network's merge size Tile, into the program's items.
//
// Needs, ahead of it, sort_bitonic.cuh and the program's kiln_sort_program (listed there),
// PARAMS and ARGS.

extern "C" __global__ void __launch_bounds__(kiln_sort_program::sort::THREADS) kiln_sort_chunks(PARAMS) {
    using P = kiln_sort_program;
    using R = P::rows;
    using S = P::sort;
    constexpr int chunks = R::np / S::TILE;
    S::item* s = (S::item*)kiln_smem;
    const int64_t row = blockIdx.x / chunks, base = (int64_t)(blockIdx.x % chunks) * S::TILE;
    S::item* g = P::items(ARGS) + row * R::np + base;
    for (int t = threadIdx.x; t < S::TILE; t += S::THREADS) s[t] = S::load(P::x(ARGS), row, base + t);
    __syncthreads();
    S::tile(s, base, 2, S::TILE);
    for (int t = threadIdx.x; t < S::TILE; t += S::THREADS) g[t] = s[t];
}
