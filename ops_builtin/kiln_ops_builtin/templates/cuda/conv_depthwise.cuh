// The pieces of kiln_ops_builtin.templates.conv_depthwise's kernel (cuda/conv_depthwise_kernel.cuh)
// and conv_depthwise_nhwc's (cuda/conv_depthwise_nhwc_kernel.cuh; the templates' docstrings tell
// the algorithms): their knobs and the convolution's geometry as types.
// Enumerators, not static constexpr members: those are emitted as .global constants.

namespace kiln::conv_depthwise {

// The compile-time knobs (conv_depthwise.py's DepthwiseKnobs, 0s resolved): Nt threads a block,
// each computing Rpt outputs of one column, rows Nt / Tw apart, of a Th x Tw tile
template <int Nt, int Tw, int Rpt>
struct Tile {
    enum { NT = Nt, TW = Tw, RPT = Rpt, TH = Nt / Tw * Rpt };
};

// The convolution: C channels of H x W input planes, Kh x Kw filters at strides Sh, Sw,
// paddings Ph, Pw and dilations Dh, Dw, OH x OW output planes
template <int C_, int H_, int W_, int Oh, int Ow, int Kh, int Kw, int Sh, int Sw, int Ph, int Pw, int Dh = 1,
          int Dw = 1>
struct Shape {
    enum { C = C_, H = H_, W = W_, OH = Oh, OW = Ow, KH = Kh, KW = Kw, SH = Sh, SW = Sw, PH = Ph, PW = Pw, DH = Dh,
           DW = Dw };
};

// conv_depthwise_nhwc's knobs (DepthwiseNHWCKnobs, fitted to the convolution): Nt threads a block,
// Cbv = Cb / V packs of V channels (G a group) x Tx strips of Px pixels x Th rows, each thread
// one strip of one row for one pack; Pix stored values a pixel of the input window in shared
// memory (its Cb channels and the padding against bank conflicts), Fill packs a thread in flight
// while filling it
template <int Cb, int V_, int G_, int Px, int Tx, int Th, int Pix, int Fill>
struct PackTile {
    enum { CB = Cb, V = V_, G = G_, CBV = Cb / V_, PX = Px, TX = Tx, TH = Th, TW = Tx * Px, NT = Cb / V_ * Tx * Th,
           PIX = Pix, FILL = Fill };
};

}  // namespace kiln::conv_depthwise
