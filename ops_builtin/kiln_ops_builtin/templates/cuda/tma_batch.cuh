// Tensor maps whose dims past columns and rows are batch dims of a flat batch index (the
// operands of kiln_ops_builtin.templates.attention_sm90 and of the sm90 engine):
// kiln::tma::Batch<Rank>, the batch dims of a map as a program renders them (sizes may be
// expressions of the kernel's size parameters), kiln::tma::with_coordinates, which calls a
// function with a flat batch's coordinates along them, and kiln::tma::load, one TMA box copy at
// those coordinates.
//
// Needs, ahead of it, the PTX wrappers MBARRIER and TMA.

namespace kiln::tma {

// A batch dim of a tensor map: flat batch bh's coordinate along it is bh / inner % size / divisor
// (divisor: a grouped-query key/value head's query heads, else 1)
struct BatchDim {
    int64_t inner, size, divisor;
    __device__ __forceinline__ int of(int64_t bh) const { return (int)(bh / inner % size / divisor); }
};

template <int Rank>
struct Batch {
    BatchDim dim[Rank];
};

template <>
struct Batch<0> {};

// f(c0, c1, ..) with flat batch bh's coordinates along `batch` (the coordinates c.. of the first
// dims taken)
template <int Rank, class F, class... Coordinates>
static __device__ __forceinline__ void with_coordinates(const Batch<Rank>& batch, int64_t bh, F&& f, Coordinates... c) {
    if constexpr (sizeof...(Coordinates) == Rank)
        f(c...);
    else
        with_coordinates(batch, bh, f, c..., batch.dim[sizeof...(Coordinates)].of(bh));
}

// The TMA copy of the box at column col, row row and flat batch bh's coordinates along `batch`
// from the tensor map `map` into `dst`, completing on mbarrier bar
template <int Rank>
static __device__ __forceinline__ void load(void* dst, const CUtensorMap* map, uint64_t* bar, int col, int row,
                                            const Batch<Rank>& batch, int64_t bh) {
    with_coordinates(batch, bh, [&](auto... c) { kiln_tma(dst, map, bar, col, row, c...); });
}

}  // namespace kiln::tma
