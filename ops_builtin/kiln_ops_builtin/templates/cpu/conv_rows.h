/* Which pixels a convolution's GEMM rows are (kiln_ops_builtin.templates.conv_cpu tells when):
   real pixels read in place where the register tile's height divides the output's width
   (ALIGNED: each panel lies in one output row); else, by the knob GATHER, real pixels whose A
   panels are gathered (1) or virtual ones, WQ to an output row, read in place (0). ROW is the
   rows to an output row, M all of them. Macros, as gemm.h picks A's code by #if A_DIRECT, ahead
   of micro.h, which defines MR. */

#define ALIGNED (OW % MR == 0)
#define A_DIRECT (ALIGNED || !GATHER)
#define ROW (ALIGNED || GATHER ? OW : WQ)
#define M (OH * ROW)
