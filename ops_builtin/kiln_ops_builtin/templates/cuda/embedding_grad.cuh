// The kernels of kiln_ops_builtin.templates.embedding_grad (its docstring tells the algorithm): an
// embedding table's gradient out[ROWS, WIDTH] from token gradients grad[TOKENS, WIDTH] and their
// rows indices[TOKENS], launched in this order: zero, sort, chunks, combine.
//
// Needs, ahead of it, the program's kiln_embedding_grad_program (embedding_grad.py renders it):
//   THREADS, CHUNK               threads a block, sorted positions a chunk
//   TOKENS, WIDTH, ROWS          T, D and the table's rows V (enumerators: static constexpr members
//   PADDING, CHUNKS              are emitted as .global); the padding row (-1: none), chunks of T
//   Acc                          the accumulator type (float for 16-bit and float32 grads, double)
//   grad(ARGS), indices(ARGS)    the inputs (kernel parameters)
//   out(ARGS)                    the output
//   order(ARGS), first(ARGS),    int temporaries of TOKENS: the token at each sorted position, the
//   last(ARGS)                   first sorted position of its index's run and the one after its last
//   head(ARGS), tail(ARGS)       Acc temporaries of CHUNKS x WIDTH: each chunk's partial sums
//   load(v), store(v)            an element of grad as an Acc, an Acc as an element of out
//   fail(index)                  an index out of range: prints it and traps
// and PARAMS and ARGS.

namespace kiln::embedding_grad {

// The table's rows a token adds to, as int64, checked: out of [0, ROWS) traps.
template <class P, class Index>
static __device__ __forceinline__ int64_t row_of(Index raw) {
    const int64_t v = (int64_t)raw;
    if (v < 0 || v >= P::ROWS) P::fail(v);
    return v;
}

}  // namespace kiln::embedding_grad

// Every element of out is zero: the rows no token adds to and the padding row stay so.
extern "C" __global__ void __launch_bounds__(kiln_embedding_grad_program::THREADS) kiln_embedding_grad_zero(PARAMS) {
    using P = kiln_embedding_grad_program;
    const auto zero = P::store((P::Acc)0);
    for (int64_t p = (int64_t)blockIdx.x * P::THREADS + threadIdx.x; p < P::ROWS * P::WIDTH;
         p += (int64_t)gridDim.x * P::THREADS)
        P::out(ARGS)[p] = zero;
}

// A stable sort of the tokens by index, by counting: token t's sorted position is the number of
// tokens with a smaller index, or the same index and an earlier position (O(T^2) comparisons,
// the indices of THREADS tokens at a time in shared memory). first and last bound the run of t's
// index (its tokens' sorted positions). An index out of range traps.
extern "C" __global__ void __launch_bounds__(kiln_embedding_grad_program::THREADS) kiln_embedding_grad_sort(PARAMS) {
    using P = kiln_embedding_grad_program;
    __shared__ int64_t keys[P::THREADS];
    const int64_t t = (int64_t)blockIdx.x * P::THREADS + threadIdx.x;
    const int64_t key = t < P::TOKENS ? kiln::embedding_grad::row_of<P>(P::indices(ARGS)[t]) : 0;
    int64_t less = 0, same = 0, before = 0;
    for (int64_t base = 0; base < P::TOKENS; base += P::THREADS) {
        __syncthreads();
        if (base + threadIdx.x < P::TOKENS) keys[threadIdx.x] = (int64_t)P::indices(ARGS)[base + threadIdx.x];
        __syncthreads();
        const int n = (int)(P::TOKENS - base < P::THREADS ? P::TOKENS - base : P::THREADS);
        for (int j = 0; j < n; ++j) {
            const int64_t k = keys[j];
            less += k < key;
            same += k == key;
            before += k == key && base + j < t;
        }
    }
    if (t < P::TOKENS) {
        const int64_t at = less + before;
        P::order(ARGS)[at] = (int)t;
        P::first(ARGS)[at] = (int)less;
        P::last(ARGS)[at] = (int)(less + same);
    }
}

// Block (c, y) sums, for its THREADS columns, the grad rows of sorted positions [c * CHUNK, ..) in
// order, one run of an index at a time: a run that lies in the chunk is rounded into its row of
// out (none for the padding row); a run that begins before the chunk leaves its part in
// head[c], one that goes on after it (and began in it) in tail[c], for kiln_embedding_grad_combine.
extern "C" __global__ void __launch_bounds__(kiln_embedding_grad_program::THREADS) kiln_embedding_grad_chunks(PARAMS) {
    using P = kiln_embedding_grad_program;
    __shared__ int token[P::CHUNK], first[P::CHUNK], last[P::CHUNK];
    __shared__ int64_t row[P::CHUNK];
    const int64_t c = blockIdx.x, lo = c * P::CHUNK;
    const int n = (int)(P::TOKENS - lo < P::CHUNK ? P::TOKENS - lo : P::CHUNK);
    const int64_t hi = lo + n;
    for (int j = threadIdx.x; j < n; j += P::THREADS) {
        const int t = P::order(ARGS)[lo + j];
        token[j] = t;
        first[j] = P::first(ARGS)[lo + j];
        last[j] = P::last(ARGS)[lo + j];
        row[j] = (int64_t)P::indices(ARGS)[t];
    }
    __syncthreads();
    const int64_t d = (int64_t)blockIdx.y * P::THREADS + threadIdx.x;
    if (d >= P::WIDTH) return;
    const auto* grad = P::grad(ARGS);
    typename P::Acc acc = 0;
    for (int j = 0; j < n; ++j) {
        acc += P::load(grad[(int64_t)token[j] * P::WIDTH + d]);
        if (lo + j + 1 == last[j] || j + 1 == n) {       // the run's part in this chunk ends here
            const bool head = first[j] < lo, tail = last[j] > hi;
            if (head)
                P::head(ARGS)[c * P::WIDTH + d] = acc;
            else if (tail)
                P::tail(ARGS)[c * P::WIDTH + d] = acc;
            else if (row[j] != P::PADDING)
                P::out(ARGS)[row[j] * P::WIDTH + d] = P::store(acc);
            acc = 0;
        }
    }
}

// Block (c, y): where a run that began in an earlier chunk c0 ends in chunk c, its parts
// (tail[c0], head[c0 + 1], ..., head[c]) are added in order and rounded into its row of out.
extern "C" __global__ void __launch_bounds__(kiln_embedding_grad_program::THREADS) kiln_embedding_grad_combine(PARAMS) {
    using P = kiln_embedding_grad_program;
    const int64_t c = blockIdx.x, lo = c * P::CHUNK, hi = lo + P::CHUNK < P::TOKENS ? lo + P::CHUNK : P::TOKENS;
    const int64_t begins = P::first(ARGS)[lo], ends = P::last(ARGS)[lo];
    const int64_t d = (int64_t)blockIdx.y * P::THREADS + threadIdx.x;
    if (begins >= lo || ends > hi || d >= P::WIDTH) return;
    const int64_t row = (int64_t)P::indices(ARGS)[P::order(ARGS)[lo]];
    if (row == P::PADDING) return;
    const int64_t c0 = begins / P::CHUNK;
    typename P::Acc acc = P::tail(ARGS)[c0 * P::WIDTH + d];
    for (int64_t k = c0 + 1; k <= c; ++k) acc += P::head(ARGS)[k * P::WIDTH + d];
    P::out(ARGS)[row * P::WIDTH + d] = P::store(acc);
}
