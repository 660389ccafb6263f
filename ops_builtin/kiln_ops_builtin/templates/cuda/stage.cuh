// Staging a GEMM operand for the tensor-core templates (kiln_ops_builtin.templates.stage says
// when): dst[x][k] = src[x * x_stride + k * k_stride] for k < K and zero for K <= k < Kp, so that
// dst's rows are K-contiguous, Kp long (a multiple of eight elements: 16-byte aligned rows) and
// the zeros add nothing to the products. One block copies a 32 x 32 tile through shared memory;
// its lanes read along whichever of x and k is contiguous in the source, and write along k.
//
// Needs the CUDA prelude (fixed-width integers) ahead of it. Guarded: a program staging both
// operands holds it twice.

#ifndef KILN_STAGE_CUH
#define KILN_STAGE_CUH

namespace kiln::stage {

struct Operand {
    int64_t x, k, kp;              // rows (m or n), the reduction length, the padded row length
    int64_t x_stride, k_stride;    // the source's element strides
};

template <typename T>
static __device__ __forceinline__ void k_major(const T* __restrict__ src, T* __restrict__ dst, const Operand o) {
    __shared__ T tile[32][33];
    const int64_t x0 = (int64_t)blockIdx.x * 32, k0 = (int64_t)blockIdx.y * 32;
    const bool lanes_along_x = o.x_stride == 1 && o.k_stride != 1;
    for (int r = threadIdx.y; r < 32; r += 8) {
        const int dx = lanes_along_x ? threadIdx.x : r, dk = lanes_along_x ? r : threadIdx.x;
        const int64_t x = x0 + dx, k = k0 + dk;
        tile[dx][dk] = (x < o.x && k < o.k) ? src[x * o.x_stride + k * o.k_stride] : (T)0;
    }
    __syncthreads();
    for (int r = threadIdx.y; r < 32; r += 8) {
        const int64_t x = x0 + r, k = k0 + threadIdx.x;
        if (x < o.x && k < o.kp) dst[x * o.kp + k] = tile[r][threadIdx.x];
    }
}

}  // namespace kiln::stage

#endif  // KILN_STAGE_CUH
