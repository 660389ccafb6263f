/* Phase planes (kiln_ops_builtin.templates.conv_cpu tells why): for strides (SH, SW), plane
   (ph, pw) of a channel holds the padded input's rows ph, ph + SH, ... and columns pw, pw + SW,
   ..., HQ x WQ floats, PAD where the input is padding (0 for a convolution, -inf for a max-pool).
   Only the phases some tap reads are kept: PSH x PSW planes a channel, all SH (SW) phases, or the
   first alone where the window is one tap tall (wide), as a strided 1x1 convolution's is.

   The problem is conv.h's; needs the hook kiln_x (an input element in float) ahead of it. */

#define PSH (KH == 1 ? 1 : SH)    /* the phases kept along h */
#define PSW (KW == 1 ? 1 : SW)    /* and along w */

/* the plane that tap (i, j) reads, among a channel's PSH x PSW */
static inline int64_t kiln_phase(int64_t i, int64_t j) { return i * DH % SH * PSW + j * DW % SW; }

/* channel c of batch b into its PSH x PSW phase planes at dst, PAD where the input is padding */
static void kiln_fill(TASK_PARAMS, int64_t b, int64_t c, float* __restrict__ dst) {
    for (int64_t ph = 0; ph < PSH; ++ph)
        for (int64_t pw = 0; pw < PSW; ++pw) {
            float* plane = dst + (ph * PSW + pw) * (HQ * WQ);
            /* columns qw whose input column qw * SW + pw - PW lies in [0, W) */
            const int64_t lo = PW > pw ? (PW - pw + SW - 1) / SW : 0;
            const int64_t hi0 = (W + PW - pw + SW - 1) / SW, hi = hi0 < WQ ? hi0 : WQ;
            for (int64_t qh = 0; qh < HQ; ++qh) {
                float* __restrict__ row = plane + qh * WQ;
                const int64_t ih = qh * SH + ph - PH;
                if (ih < 0 || ih >= H || lo >= hi) {
                    for (int64_t qw = 0; qw < WQ; ++qw) row[qw] = PAD;
                    continue;
                }
                for (int64_t qw = 0; qw < lo; ++qw) row[qw] = PAD;
                for (int64_t qw = lo; qw < hi; ++qw) row[qw] = kiln_x(TASK_ARGS, b, c, ih, qw * SW + pw - PW);
                for (int64_t qw = hi; qw < WQ; ++qw) row[qw] = PAD;
            }
        }
}
