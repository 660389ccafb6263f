// split_k's blocks for a template whose block owns a tile of Rows x Columns outputs (rows m of
// Columns neighbouring columns n, those at n >= n_end left out), computed by
// part(tile, split, store): the tile's partial over the k-tiles of one split, each element
// handed to store(m, n, value) once. kiln_ops_builtin.templates.split_k's docstring tells the
// two layouts:
//   kiln_split_k_program::CLUSTER == 0: grid (tiles, SPLIT, batch); each block stores its own
//     partial (the workspace's, or the epilogue where SPLIT == 1): store(split, m, n, value);
//   CLUSTER == 1: grid (tiles * SPLIT, 1, batch) in clusters of SPLIT along x, rank = split;
//     the partials wait in shared memory, then each block adds those of its slice of the tile,
//     in the order of the splits (split_k_sum.cuh's), and stores them: store(0, m, n, sum).
// Needs, ahead of it, the PTX wrappers DSMEM and the program's kiln_split_k_program.
template <int Rows, int Columns, class Part, class Store>
static __device__ __forceinline__ void kiln_split_k_tiles(int64_t n_end, Part part, Store store) {
    using P = kiln_split_k_program;
    if constexpr (!P::CLUSTER) {
        const int split = blockIdx.y;
        part((int64_t)blockIdx.x, split, [&](int m, int64_t n, float v) { store(split, m, n, v); });
    } else {
        __shared__ float partial[Rows][Columns];
        const int split = (int)kiln_cluster_rank();
        const int64_t n0 = (int64_t)(blockIdx.x / P::SPLIT) * Columns;
        part((int64_t)(blockIdx.x / P::SPLIT), split, [&](int m, int64_t n, float v) { partial[m][n - n0] = v; });
        kiln_cluster_sync();
        constexpr int elements = Rows * Columns, share = (elements + P::SPLIT - 1) / P::SPLIT;
        const int end = min(elements, (split + 1) * share);
        for (int i = split * share + (int)threadIdx.x; i < end; i += (int)blockDim.x) {
            const int m = i / Columns, c = i % Columns;
            if (n0 + c >= n_end) continue;
            float v = 0.f;
#pragma unroll
            for (int s = 0; s < P::SPLIT; ++s) v += kiln_cluster_load(&partial[m][c], s);
            store(0, m, n0 + c, v);
        }
        kiln_cluster_sync();    // no block leaves while the others read its partial
    }
}
