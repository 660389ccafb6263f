/* Which pixels a convolution's GEMM rows are (kiln_ops_builtin.templates.conv_cpu tells when):
   real pixels read in place where the register tile's height divides the output's width
   (ALIGNED: each panel lies in one output row); else, by the knob GATHER, real pixels whose A
   panels are gathered (1) or virtual ones, WQ to an output row, read in place (0). ROW is the
   rows to an output row, M all of them. Macros, as gemm.h picks A's code by #if A_DIRECT, ahead
   of micro.h, which defines MR.

   IN_PLACE: the planes are the input INPUT_PLANES itself, where it is laid out as they are
   (INPUT_PLANES_OK: float32, no padding, one phase, the planes its size) and no row reads past
   its output row (real pixels: ALIGNED or GATHER; the last panel of virtual pixels reads past
   the planes' end, into their tail of PLANE_TAIL floats). LAST_COPIED: laid out so, but with
   virtual pixels (AVX2's 6-row tiles on ResNet's 1x1 convolutions, whose widths 6 does not
   divide): every image but the last read in place, whose reads past its planes fall in the
   next image's; the last copied, with the tail. PLANE: an image's floats as the planes are
   filled; INPUT_IMAGE: as the input holds them. Needs planes.h ahead of it. */

#define ALIGNED (OW % MR == 0)
#define A_DIRECT (ALIGNED || !GATHER)
#define ROW (ALIGNED || GATHER ? OW : WQ)
#define M (OH * ROW)
#define IN_PLACE (INPUT_PLANES_OK && (ALIGNED || GATHER))
#define LAST_COPIED (INPUT_PLANES_OK && !IN_PLACE && IMAGES > 1)
#define INPUT_IMAGE (CIN * PSH * PSW * HQ * WQ)
#define PLANE (INPUT_IMAGE + (IN_PLACE ? 0 : PLANE_TAIL))
/* A's rows of k as micro.h reads them in place (A_DIRECT): an input channel's KH x KW taps, a
   channel's PSH x PSW planes apart; tap t = (i, j) at row i * DH / SH, column j * DW / SW of
   plane kiln_phase(i, j) */
#define A_TAPS (KH * KW)
#define A_CHANNEL (PSH * PSW * HQ * WQ)
#define A_TAP(t) (kiln_phase((t) / KW, (t) % KW) * (HQ * WQ) + (t) / KW * DH / SH * WQ + (t) % KW * DW / SW)
