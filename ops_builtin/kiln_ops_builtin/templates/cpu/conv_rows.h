/* Which pixels a convolution's GEMM rows are (kiln_ops_builtin.templates.conv_cpu tells when):
   real pixels read in place where the register tile's height divides the output's width
   (ALIGNED: each panel lies in one output row); else, by the knob GATHER, real pixels whose A
   panels are gathered (1) or virtual ones, WQ to an output row, read in place (0). ROW is the
   rows to an output row, M all of them. Macros, as gemm.h picks A's code by #if A_DIRECT, ahead
   of micro.h, which defines MR.

   IN_PLACE: the planes are the input INPUT_PLANES itself, where it is laid out as they are
   (INPUT_PLANES_OK: float32, no padding, one phase, the planes its size) and no row reads past
   its output row (real pixels: ALIGNED or GATHER; the last panel of virtual pixels reads past
   the planes' end, into their tail of PLANE_TAIL floats). PLANE: an image's floats. */

#define ALIGNED (OW % MR == 0)
#define A_DIRECT (ALIGNED || !GATHER)
#define ROW (ALIGNED || GATHER ? OW : WQ)
#define M (OH * ROW)
#define IN_PLACE (INPUT_PLANES_OK && (ALIGNED || GATHER))
#define PLANE (CIN * PSH * PSW * HQ * WQ + (IN_PLACE ? 0 : PLANE_TAIL))
