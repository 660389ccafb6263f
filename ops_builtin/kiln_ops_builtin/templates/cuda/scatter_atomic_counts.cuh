// The counting kernels of kiln_ops_builtin.templates.scatter_atomic, ahead of scatter_atomic.cuh's
// where some outputs keep x's value only if no source lands on them or a mean divides by counts:
// zero the counts, then count the sources landing on each output. Needs what scatter_atomic.cuh
// needs.
extern "C" __global__ void __launch_bounds__(kiln_scatter_program::THREADS) kiln_scatter_zero(PARAMS) {
    using P = kiln_scatter_program;
    for (int64_t p = (int64_t)blockIdx.x * P::THREADS + threadIdx.x; p < P::NUMEL; p += (int64_t)gridDim.x * P::THREADS)
        P::counts(ARGS)[p] = 0;
}

extern "C" __global__ void __launch_bounds__(kiln_scatter_program::THREADS) kiln_scatter_count(PARAMS) {
    using P = kiln_scatter_program;
    for (int64_t s = (int64_t)blockIdx.x * P::THREADS + threadIdx.x; s < P::SOURCES; s += (int64_t)gridDim.x * P::THREADS)
        atomicAdd(&P::counts(ARGS)[kiln_target(ARGS, s)], 1);
}

