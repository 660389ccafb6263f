// The kernels of kiln_ops_builtin.templates.scatter_atomic (its docstring tells the algorithm), each
// a grid-stride loop over the output's elements or over the sources; the program launches those
// it needs, in this order, after scatter_atomic_counts.cuh's where it counts.
//
// Needs, ahead of it, the program's kiln_scatter_program (scatter_atomic.py renders it):
//   THREADS, NUMEL, SOURCES     threads a block, the output's elements, the source elements
//   INCLUDE_SELF, MEAN          whether x's own value is combined, the counts divide the result
//                               (enumerators: static constexpr members are emitted as .global)
//   Acc                         the accumulator type
//   x(ARGS), out(ARGS)          the input x and the output (kernel parameters)
//   acc(ARGS), counts(ARGS)     the accumulators and the counts (the output or temporaries)
//   load_x(v), store(v)         an element of x as a value, an accumulator as an output element
//   identity(), divide(a, b)    the reduction's identity, a mean's division
//   COMBINE, combined(a, v)     how a value is combined into an accumulator (kiln::scatter::Combine),
//                               and with CAS the combination of accumulator a and value v
// scatter_combine.cuh's kiln::scatter::combine, and the hooks kiln_target(ARGS, s), kiln_value(ARGS, s),
// PARAMS and ARGS.

extern "C" __global__ void __launch_bounds__(kiln_scatter_program::THREADS) kiln_scatter_init(PARAMS) {
    using P = kiln_scatter_program;
    for (int64_t p = (int64_t)blockIdx.x * P::THREADS + threadIdx.x; p < P::NUMEL; p += (int64_t)gridDim.x * P::THREADS) {
        P::Acc v = (P::Acc)P::load_x(P::x(ARGS)[p]);
        if constexpr (!P::INCLUDE_SELF)
            if (P::counts(ARGS)[p] > 0) v = P::identity();
        P::acc(ARGS)[p] = v;
    }
}

extern "C" __global__ void __launch_bounds__(kiln_scatter_program::THREADS) kiln_scatter_apply(PARAMS) {
    using P = kiln_scatter_program;
    for (int64_t s = (int64_t)blockIdx.x * P::THREADS + threadIdx.x; s < P::SOURCES; s += (int64_t)gridDim.x * P::THREADS)
        kiln::scatter::combine<P>(&P::acc(ARGS)[kiln_target(ARGS, s)], kiln_value(ARGS, s));
}

extern "C" __global__ void __launch_bounds__(kiln_scatter_program::THREADS) kiln_scatter_finish(PARAMS) {
    using P = kiln_scatter_program;
    for (int64_t p = (int64_t)blockIdx.x * P::THREADS + threadIdx.x; p < P::NUMEL; p += (int64_t)gridDim.x * P::THREADS) {
        P::Acc v = P::acc(ARGS)[p];
        if constexpr (P::MEAN)
            if (P::counts(ARGS)[p] > 0) v = P::divide(v, (P::Acc)(P::counts(ARGS)[p] + P::INCLUDE_SELF));
        P::out(ARGS)[p] = P::store(v);
    }
}
