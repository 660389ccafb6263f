// Sorting rows by a bitonic network, for kiln_ops_builtin.templates.sort_bitonic (its docstring
// tells the algorithm): every element becomes an item (an order-preserving key and its position
// in the row), each row padded to np items (a power of two) after every real one, and the items
// sort by (key, position).
//
// Everything is compiled in, as template parameters of kiln::sort::Sort: the element type (F32
// ... Bool below: its storage, the items of its key width, its key, NaN's key), the rows
// (kiln::sort::Rows: the sizes, on which the launches depend), the knobs Tile (items sorted in
// shared memory at once) and Threads (per block), the order, what each row outputs (Statistic)
// and whether values go out with the indices. Sort's functions are what the kernels call
// (sort_bitonic_rows.cuh for rows of at most Tile items; for longer ones sort_bitonic_chunks.cuh,
// the merge kernels sort_bitonic.py renders, sort_bitonic_emit.cuh): loading items, the
// network's steps over a tile, merge steps over rows in global memory, the outputs.
// A kernel's own loops are written in the kernel, not in a Sort function it calls: NVRTC
// optimizes a loop in an inlined function otherwise, and the machine code would change.
//
// The kernels read the program's kiln_sort_program (sort_bitonic.py renders it after this file):
//   rows, sort                    the kiln::sort::Rows and kiln::sort::Sort of the task and knobs
//   x(ARGS)                       the input
//   values(ARGS), indices(ARGS)   the outputs (values nullptr for argsort)
//   items(ARGS)                   long rows' sorted items (a temporary of rows * np items)
// and PARAMS and ARGS.
//
// Needs the CUDA prelude (fixed-width integers) ahead of it.

// The block's dynamic shared memory, where the kernels hold a tile of items (declared out of
// the namespace: its PTX name is then unmangled)
extern __shared__ uint4 kiln_smem[];

namespace kiln::sort {

// Items of 32-bit keys: key and position in one 64-bit word, ordered as integers
struct Items32 {
    using key = uint32_t;
    using item = uint64_t;
    static __device__ __forceinline__ item of(key k, uint32_t at) { return ((uint64_t)k << 32) | at; }
    static __device__ __forceinline__ key key_of(item a) { return (key)(a >> 32); }
    static __device__ __forceinline__ uint32_t position_of(item a) { return (uint32_t)a; }
    static __device__ __forceinline__ bool before(item a, item b) { return a < b; }
};

// Items of 64-bit keys: a pair
struct Item64 {
    uint64_t key;
    uint32_t at;
};

struct Items64 {
    using key = uint64_t;
    using item = Item64;
    static __device__ __forceinline__ item of(key k, uint32_t at) { item a; a.key = k; a.at = at; return a; }
    static __device__ __forceinline__ key key_of(item a) { return a.key; }
    static __device__ __forceinline__ uint32_t position_of(item a) { return a.at; }
    static __device__ __forceinline__ bool before(item a, item b) {
        return a.key < b.key || (a.key == b.key && a.at < b.at);
    }
};

// The key of a float's bits (`sign` its sign bit, `inf` the bits of +inf): ordered as the
// values, -0.0 as 0.0, every NaN the largest key of the width
template <typename Key>
static __device__ __forceinline__ Key float_key(Key bits, Key sign, Key inf) {
    const Key magnitude = bits & (sign - 1);
    if (magnitude > inf) return sign | (sign - 1);
    if (magnitude == 0) return sign;
    return (bits & sign) ? (~bits & (sign | (sign - 1))) : (bits | sign);
}

// An element type: its storage, items and NaN's key (0 where it has no NaN; a function, as a
// static constexpr member would be emitted as a device variable under -default-device)
template <typename Storage, typename Items, typename Items::key NaN>
struct Element {
    using storage = Storage;
    using items = Items;
    static __device__ __forceinline__ constexpr typename Items::key nan() { return NaN; }
};

struct F32 : Element<float, Items32, 0xffffffffu> {
    static __device__ __forceinline__ uint32_t key(float v) {
        return float_key<uint32_t>(__float_as_uint(v), 0x80000000u, 0x7f800000u);
    }
};

struct F16 : Element<uint16_t, Items32, 0xffffu> {
    static __device__ __forceinline__ uint32_t key(uint16_t v) {
        return float_key<uint32_t>((uint32_t)(v), 0x8000u, 0x7c00u);
    }
};

struct BF16 : Element<uint16_t, Items32, 0xffffu> {
    static __device__ __forceinline__ uint32_t key(uint16_t v) {
        return float_key<uint32_t>((uint32_t)(v), 0x8000u, 0x7f80u);
    }
};

struct F64 : Element<double, Items64, 0xffffffffffffffffull> {
    static __device__ __forceinline__ uint64_t key(double v) {
        return float_key<uint64_t>((uint64_t)__double_as_longlong(v), 0x8000000000000000ull, 0x7ff0000000000000ull);
    }
};

// Signed integers with the sign bit flipped
struct I64 : Element<int64_t, Items64, 0> {
    static __device__ __forceinline__ uint64_t key(int64_t v) { return (uint64_t)(v) ^ 0x8000000000000000ull; }
};

struct I32 : Element<int32_t, Items32, 0> {
    static __device__ __forceinline__ uint32_t key(int32_t v) { return (uint32_t)(v) ^ 0x80000000u; }
};

struct I16 : Element<int16_t, Items32, 0> {
    static __device__ __forceinline__ uint32_t key(int16_t v) { return (uint32_t)(uint16_t)(v) ^ 0x8000u; }
};

struct I8 : Element<int8_t, Items32, 0> {
    static __device__ __forceinline__ uint32_t key(int8_t v) { return (uint32_t)(uint8_t)(v) ^ 0x80u; }
};

struct U8 : Element<uint8_t, Items32, 0> {
    static __device__ __forceinline__ uint32_t key(uint8_t v) { return (uint32_t)(v); }
};

struct Bool : Element<bool, Items32, 0> {
    static __device__ __forceinline__ uint32_t key(bool v) { return (uint32_t)(v); }
};

// The rows, compiled in (the launches depend on np: a program sorts rows of one size): RowCount
// rows of N elements, Inner apart (row o * Inner + i holds x[o, 0..N, i]), padded to Np items;
// Kout outputs a row along the sorted dim, Emits of them computed (1 for a statistic), Kth for
// Statistic::Kth. Enumerators: constants wherever they are read, and no device variables.
template <int64_t N, int64_t RowCount, int64_t Inner, int Np, int Kout, int Emits, int Kth>
struct Rows {
    enum : int64_t { n = N, rows = RowCount, inner = Inner };
    enum : int { np = Np, kout = Kout, emits = Emits, kth = Kth };
};

// What output element r of a row reads: the item of rank r (sort, argsort, topk), of rank
// kth - 1, the median's (a row with NaN: its first NaN), or the median of its numbers
enum class Statistic { Rank, Kth, Median, NanMedian };

template <typename E, typename P, int Tile, int Threads, bool Descending, Statistic S, bool Values>
struct Sort {
    using I = typename E::items;
    using key = typename I::key;
    using item = typename I::item;
    using T = typename E::storage;
    enum : int { TILE = Tile, THREADS = Threads };

    // The item of position j of row `row`: past the row's end (or the last row), one after every real item
    static __device__ __forceinline__ item load(const T* __restrict__ x, int64_t row, int64_t j) {
        if (j >= P::n || row >= P::rows) return I::of(~(key)0, (uint32_t)j);
        const T v = x[(row / P::inner * P::n + j) * P::inner + row % P::inner];
        const key k = E::key(v);
        return I::of(Descending ? ~k : k, (uint32_t)j);
    }

    static __device__ __forceinline__ void order(item* a, item* b, bool up) {
        const item x = *a, y = *b;
        if (I::before(y, x) == up) { *a = y; *b = x; }
    }

    // The network's steps of merge sizes k_first..k_last (doubling) and strides below Tile over
    // the Tile items `s` in shared memory, item i at position base + i % seg of its row
    static __device__ __forceinline__ void tile(item* s, int64_t base, int64_t k_first, int64_t k_last) {
        const int seg = P::np < Tile ? P::np : Tile;
        for (int64_t k = k_first; k <= k_last; k <<= 1) {
            for (int j = (int)((k < Tile ? k : Tile) >> 1); j > 0; j >>= 1) {
                for (int q = threadIdx.x; q < Tile / 2; q += Threads) {
                    const int i = 2 * q - (q & (j - 1));
                    order(s + i, s + i + j, ((base + (i & (seg - 1))) & k) == 0);
                }
                __syncthreads();
            }
        }
    }

    // How many items of the sorted row `s` hold numbers (NaN's key is the largest but padding's)
    static __device__ __forceinline__ int64_t numbers(const item* s) {
        int64_t lo = 0, hi = P::n;
        while (lo < hi) {
            const int64_t mid = (lo + hi) / 2;
            if (I::key_of(s[mid]) < (key)E::nan()) lo = mid + 1; else hi = mid;
        }
        return lo;
    }

    // Output element r (along the sorted dim) of row `row`, from its sorted items `s`
    static __device__ __forceinline__ void emit(const T* __restrict__ in, T* __restrict__ values,
                                                int64_t* __restrict__ indices, const item* s, int64_t row, int64_t r) {
        int64_t rank = r;
        if constexpr (S == Statistic::Kth) {
            rank = P::kth - 1;
        } else if constexpr (S == Statistic::Median) {
            const int64_t counted = E::nan() ? numbers(s) : P::n;
            rank = counted < P::n ? counted : (P::n - 1) / 2;
        } else if constexpr (S == Statistic::NanMedian) {
            const int64_t counted = E::nan() ? numbers(s) : P::n;
            rank = (counted > 0 ? counted - 1 : 0) / 2;
        }
        const int64_t o = row / P::inner, i = row % P::inner, at = (o * P::kout + r) * P::inner + i;
        const int64_t position = I::position_of(s[rank]);
        if constexpr (Values) values[at] = in[(o * P::n + position) * P::inner + i];
        indices[at] = position;
    }

    // One step (merge size K, stride J >= Tile) over every row of `items`
    template <int64_t K, int64_t J>
    static __device__ __forceinline__ void merge_step(item* __restrict__ items) {
        for (int64_t q = (int64_t)blockIdx.x * Threads + threadIdx.x; q < P::rows * (P::np / 2);
             q += (int64_t)gridDim.x * Threads) {
            const int64_t row = q / (P::np / 2), c = q % (P::np / 2), i = 2 * c - (c & (J - 1));
            order(items + row * P::np + i, items + row * P::np + i + J, (i & K) == 0);
        }
    }

    // The steps of merge size K and strides below Tile over one chunk of `items`, through the
    // Tile items of the block's shared memory
    template <int64_t K>
    static __device__ __forceinline__ void merge_chunk(item* __restrict__ items) {
        item* s = (item*)kiln_smem;
        const int chunks = P::np / Tile;
        const int64_t row = blockIdx.x / chunks, base = (int64_t)(blockIdx.x % chunks) * Tile;
        item* g = items + row * P::np + base;
        for (int t = threadIdx.x; t < Tile; t += Threads) s[t] = g[t];
        __syncthreads();
        tile(s, base, K, K);
        for (int t = threadIdx.x; t < Tile; t += Threads) g[t] = s[t];
    }
};

}  // namespace kiln::sort
