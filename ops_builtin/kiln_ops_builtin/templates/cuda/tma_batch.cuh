// Tensor maps whose dims past columns and rows are batch dims of a flat batch index (the
// operands of kiln_ops_builtin.templates.attention_sm90): kiln::tma::Batch<N>, the N batch dims of
// a map as a program renders them (sizes may be expressions of the kernel's size parameters),
// and kiln::tma::load, one TMA box copy at a flat batch's coordinates along them.
//
// Needs, ahead of it, the PTX wrappers MBARRIER and TMA.

namespace kiln::tma {

// A batch dim of a tensor map: flat batch bh's coordinate along it is bh / inner % size / divisor
// (divisor: a grouped-query key/value head's query heads, else 1)
struct BatchDim {
    int64_t inner, size, divisor;
    __device__ __forceinline__ int of(int64_t bh) const { return (int)(bh / inner % size / divisor); }
};

template <int N>
struct Batch {
    BatchDim dim[N];
};

template <>
struct Batch<0> {};

// The TMA copy of the box at column col, row row and flat batch bh's coordinates along `batch`
// (the coordinates c.. of the first dims taken) from the tensor map `map` into `dst`, completing
// on mbarrier bar
template <int N, typename... Coordinates>
static __device__ __forceinline__ void load(void* dst, const CUtensorMap* map, uint64_t* bar, int col, int row,
                                            const Batch<N>& batch, int64_t bh, Coordinates... c) {
    if constexpr (sizeof...(Coordinates) == N)
        kiln_tma(dst, map, bar, col, row, c...);
    else
        load(dst, map, bar, col, row, batch, bh, c..., batch.dim[sizeof...(Coordinates)].of(bh));
}

}  // namespace kiln::tma
