// The kernel of kiln_ops_builtin.templates.conv_depthwise (its docstring tells the algorithm): a
// block's TH x TW tile of one output plane (blockIdx.x: image x channel; blockIdx.y, blockIdx.z:
// the tile's row and column), each output handed to the core's epilogue hook with GEMM row m the
// plane and column n the output pixel.
//
// Needs, ahead of it, conv_depthwise.cuh and the program's kiln_conv_depthwise_program
// (conv_depthwise.py renders it):
//   Tile, Shape          kiln::conv_depthwise::Tile<...> (the knobs), Shape<...> (the convolution)
//   Acc                  the accumulator type
//   x(ARGS), w(ARGS)     the input and the filter (their kernel parameters)
//   load(v)              an element of them as a value of its type's arithmetic (float for 16-bit floats)
// and the epilogue hook's PARAMS, ARGS.
extern "C" __global__ void __launch_bounds__(kiln_conv_depthwise_program::Tile::NT) kiln_conv_depthwise(PARAMS) {
    using P = kiln_conv_depthwise_program;
    using T = P::Tile;
    using S = P::Shape;
    using Acc = P::Acc;
    constexpr int NT = T::NT, TW = T::TW, TH = T::TH, RPT = T::RPT;
    constexpr int C = S::C, H = S::H, W = S::W, OH = S::OH, OW = S::OW, KH = S::KH, KW = S::KW, SH = S::SH,
                  SW = S::SW, PH = S::PH, PW = S::PW;
    constexpr int IH_T = (TH - 1) * SH + KH, IW_T = (TW - 1) * SW + KW;     // the input window of a tile
    __shared__ Acc xs[IH_T * IW_T];
    __shared__ Acc ws[KH * KW];
    const int64_t plane = blockIdx.x;
    const int c = (int)(plane % C);
    const int oh0 = blockIdx.y * TH, ow0 = blockIdx.z * TW;
    const int ih0 = oh0 * SH - PH, iw0 = ow0 * SW - PW;
    const auto* xp = P::x(ARGS) + plane * (int64_t)(H * W);
    for (int i = threadIdx.x; i < IH_T * IW_T; i += NT) {
        const int ih = ih0 + i / IW_T, iw = iw0 + i % IW_T;
        xs[i] = ih >= 0 && ih < H && iw >= 0 && iw < W ? (Acc)P::load(xp[ih * W + iw]) : (Acc)0;
    }
    for (int i = threadIdx.x; i < KH * KW; i += NT) ws[i] = (Acc)P::load(P::w(ARGS)[(int64_t)c * (KH * KW) + i]);
    __syncthreads();
    const int tx = threadIdx.x % TW, ty = threadIdx.x / TW, ow = ow0 + tx;
#pragma unroll
    for (int r = 0; r < RPT; ++r) {
        const int oy = ty + r * (NT / TW), oh = oh0 + oy;
        if (oh < OH && ow < OW) {
            Acc acc = 0;
#pragma unroll
            for (int kh = 0; kh < KH; ++kh)
#pragma unroll
                for (int kw = 0; kw < KW; ++kw) acc += xs[(oy * SH + kh) * IW_T + tx * SW + kw] * ws[kh * KW + kw];
            kiln_epilogue(ARGS, 0, plane, (int64_t)oh * OW + ow, acc);
        }
    }
}
