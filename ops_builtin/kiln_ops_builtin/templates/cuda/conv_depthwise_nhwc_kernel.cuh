// The kernel of kiln_ops_builtin.templates.conv_depthwise_nhwc (its docstring tells the algorithm):
// a block's TH x TW x CB tile of one image's channels-last output (blockIdx.x: the image's tile,
// then the tile's channel block), each thread PX pixels of one row for a pack of V channels,
// handed to the core's vector epilogue hook with GEMM row m the output pixel and column n the
// channel.
//
// Needs, ahead of it, conv_depthwise.cuh and the program's kiln_conv_depthwise_nhwc_program
// (conv_depthwise_nhwc.py renders it):
//   Tile, Shape          kiln::conv_depthwise::PackTile<...> (the knobs), Shape<...> (the convolution)
//   T, S                 the input's storage type and that of the window in shared memory (T or float)
//   x(ARGS)              the input (its kernel parameter)
//   w(ARGS, i)           the filter's element i (read on the parameter itself: through a returned
//                        pointer NVRTC orders the kernel's first instructions differently)
//   load(v)              an element of them as a value of its type's arithmetic (float for 16-bit floats)
//   store_s(v), load_s(v)  an element into the window's type, a window value into float
// and the epilogue hook's PARAMS, ARGS.
extern "C" __global__ void __launch_bounds__(kiln_conv_depthwise_nhwc_program::Tile::NT)
kiln_conv_depthwise_nhwc(PARAMS) {
    using P = kiln_conv_depthwise_nhwc_program;
    using K = P::Tile;
    using Z = P::Shape;
    using T = P::T;
    using S = P::S;
    typedef float Acc;
    constexpr int NT = K::NT, CB = K::CB, V = K::V, G = K::G, CBV = K::CBV, PX = K::PX, TX = K::TX, TH = K::TH,
                  TW = K::TW, PIX = K::PIX, FILL = K::FILL;
    constexpr int C = Z::C, H = Z::H, W = Z::W, OH = Z::OH, OW = Z::OW, KH = Z::KH, KW = Z::KW, SH = Z::SH,
                  SW = Z::SW, PH = Z::PH, PW = Z::PW, DH = Z::DH, DW = Z::DW;
    // the input window of a tile
    constexpr int IH_T = (TH - 1) * SH + (KH - 1) * DH + 1, IW_T = (TW - 1) * SW + (KW - 1) * DW + 1;
    constexpr int NWIN = (PX - 1) * SW + (KW - 1) * DW + 1;    // a row's input pixels under a thread's PX outputs
    constexpr int TILES_Y = (OH + TH - 1) / TH, TILES_X = (OW + TW - 1) / TW, CBLOCKS = (C + CB - 1) / CB;
    // stored values a shared-memory access (16 bytes at most, a pack at most); weights likewise, WQ of them a pack
    constexpr int QW = V < 16 / (int)sizeof(S) ? V : 16 / (int)sizeof(S);
    constexpr int WQW = V * G < 4 ? V * G : 4, WQ = V * G / 4 > 1 ? V * G / 4 : 1;
    typedef kiln_pack<T, V> in_pack;
    typedef kiln_pack<S, QW> quad;
    typedef kiln_pack<Acc, WQW> weight_quad;
    extern __shared__ float4 kiln_dw_smem[];
    // the input window, in S: quad h of channel pack cv of pixel p at p * PIX + (h * CBV + cv) * QW
    S* xs = (S*)kiln_dw_smem;
    // the filters: quad h of the V * G weights of channel pack cv for tap t at ((t * WQ + h) * CBV + cv) * WQW
    Acc* ws = (Acc*)(xs + IH_T * IW_T * PIX);
    // the channel blocks of a tile are neighbours in the grid: they read the same input lines
    const int tile = blockIdx.x / CBLOCKS, c0 = blockIdx.x % CBLOCKS * CB;
    const int b = tile / (TILES_Y * TILES_X), oh0 = tile / TILES_X % TILES_Y * TH, ow0 = tile % TILES_X * TW;
    const int ih0 = oh0 * SH - PH, iw0 = ow0 * SW - PW;
    // FILL packs a thread in flight at once: their loads are issued before any is stored
    for (int i0 = threadIdx.x; i0 < IH_T * IW_T * CBV; i0 += NT * FILL) {
        in_pack raw[FILL];
#pragma unroll
        for (int u = 0; u < FILL; ++u) {
            const int i = i0 + u * NT, p = i / CBV, cv = i - p * CBV, iy = ih0 + p / IW_T, ix = iw0 + p % IW_T;
            const int c = c0 + cv * V;
            if (i < IH_T * IW_T * CBV && (unsigned)iy < (unsigned)H && (unsigned)ix < (unsigned)W && c < C)
                raw[u] = *(const in_pack*)&P::x(ARGS)[((int64_t)(b * H + iy) * W + ix) * C + c];
            else
#pragma unroll
                for (int e = 0; e < V; ++e) raw[u].v[e] = (T)0;
        }
#pragma unroll
        for (int u = 0; u < FILL; ++u) {
            const int i = i0 + u * NT, p = i / CBV, cv = i - p * CBV;
            if (i >= IH_T * IW_T * CBV) break;
#pragma unroll
            for (int h = 0; h < V / QW; ++h) {
                quad q;
#pragma unroll
                for (int j = 0; j < QW; ++j) q.v[j] = P::store_s(raw[u].v[h * QW + j]);
                *(quad*)&xs[p * PIX + (h * CBV + cv) * QW] = q;
            }
        }
    }
    for (int i = threadIdx.x; i < KH * KW * CB * G; i += NT) {
        const int r = i / (WQW * CBV) % WQ * WQW + i % WQW, cv = i / WQW % CBV, tap = i / (WQW * CBV * WQ);
        const int c = c0 + cv * V + r / G;        // weight r = e * G + g of the pack: channel e, group input g
        ws[i] = c < C ? (Acc)P::load(P::w(ARGS, ((int64_t)c * (KH * KW) + tap) * G + r % G)) : (Acc)0;
    }
    __syncthreads();
    const int cv = threadIdx.x % CBV, strip = threadIdx.x / CBV % TX, row = threadIdx.x / (CBV * TX);
    const int c = c0 + cv * V, oh = oh0 + row, ow = ow0 + strip * PX;
    if (c >= C || oh >= OH || ow >= OW) return;
    Acc acc[PX][V];
#pragma unroll
    for (int p = 0; p < PX; ++p)
#pragma unroll
        for (int e = 0; e < V; ++e) acc[p][e] = (Acc)0;
#pragma unroll
    for (int ky = 0; ky < KH; ++ky) {
        // the row's NWIN pixels under the thread's PX outputs, read from shared memory once and
        // reused by every tap over them
        const S* xrow = xs + ((row * SH + ky * DH) * IW_T + strip * PX * SW) * PIX + cv * QW;
        Acc win[NWIN][V];
#pragma unroll
        for (int x = 0; x < NWIN; ++x)
#pragma unroll
            for (int h = 0; h < V / QW; ++h) {
                const quad q = *(const quad*)&xrow[x * PIX + h * CBV * QW];
#pragma unroll
                for (int j = 0; j < QW; ++j) win[x][h * QW + j] = P::load_s(q.v[j]);
            }
#pragma unroll
        for (int kx = 0; kx < KW; ++kx) {
            Acc w[V * G];
#pragma unroll
            for (int h = 0; h < WQ; ++h) {
                const weight_quad q = *(const weight_quad*)&ws[(((ky * KW + kx) * WQ + h) * CBV + cv) * WQW];
#pragma unroll
                for (int j = 0; j < WQW; ++j) w[h * WQW + j] = q.v[j];
            }
#pragma unroll
            for (int p = 0; p < PX; ++p)
#pragma unroll
                for (int e = 0; e < V; ++e)
#pragma unroll
                    for (int g = 0; g < G; ++g) acc[p][e] += win[p * SW + kx * DW][e / G * G + g] * w[e * G + g];
        }
    }
    const int64_t m = ((int64_t)b * OH + oh) * OW + ow;
#pragma unroll
    for (int p = 0; p < PX; ++p)
        if (ow + p < OW) kiln_epilogue_v(ARGS, 0, m + p, c, acc[p]);
}
