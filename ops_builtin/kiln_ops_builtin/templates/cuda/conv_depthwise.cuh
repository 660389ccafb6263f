// The pieces of kiln_ops_builtin.templates.conv_depthwise's kernel (cuda/conv_depthwise_kernel.cuh;
// the template's docstring tells the algorithm): its knobs and the convolution's geometry as types.
// Enumerators, not static constexpr members: those are emitted as .global constants.

namespace kiln::conv_depthwise {

// The compile-time knobs (conv_depthwise.py's DepthwiseKnobs, 0s resolved): Nt threads a block,
// each computing Rpt outputs of one column, rows Nt / Tw apart, of a Th x Tw tile
template <int Nt, int Tw, int Rpt>
struct Tile {
    enum { NT = Nt, TW = Tw, RPT = Rpt, TH = Nt / Tw * Rpt };
};

// The convolution: C channels of H x W input planes, Kh x Kw filters at strides Sh, Sw and
// paddings Ph, Pw, OH x OW output planes
template <int C_, int H_, int W_, int Oh, int Ow, int Kh, int Kw, int Sh, int Sw, int Ph, int Pw>
struct Shape {
    enum { C = C_, H = H_, W = W_, OH = Oh, OW = Ow, KH = Kh, KW = Kw, SH = Sh, SW = Sw, PH = Ph, PW = Pw };
};

}  // namespace kiln::conv_depthwise
