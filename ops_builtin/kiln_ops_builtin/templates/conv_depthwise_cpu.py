"""Depthwise conv2d on the CPU (one group per channel: MobileNet's 3x3 convolutions), vectorized
along the output's rows.

Threads take (batch, channel) pairs. Each copies its channel into zero-padded phase planes
(`conv_cpu.FILL`: for stride s, plane (ph, pw) holds the padded input's rows ph, ph + s, ...
and columns pw, pw + s, ...), so that for every kernel tap the inputs of consecutive output
columns are consecutive floats of one plane, for any stride, padding and dilation. An output
row is then computed in blocks of DW_VECS vectors: per tap, one broadcast weight times
unaligned loads of the plane, no bounds tests (columns past the row are computed from the
planes' zeros or the next row and not stored). The block goes through the epilogue hook
(bias, folded batch norm, ReLU6, residual add: whatever fusion put there). 16-bit inputs
are converted to float32 as the planes are filled, and accumulate in float32. Sizes are fixed,
as `conv_cpu`'s. The kernel takes its reduction from macros (`DW_INIT`, `DW_TAP`, `DW_WEIGHTS`),
so that `pool_cpu` runs max-pools on it.
"""
from __future__ import annotations

from kiln.template import CpuProgram, KernelArgs, Template

from kiln_ops_builtin.templates.conv_cpu import FILL, ConvCpu, match_conv, source

KERNEL = r"""
#define DW_COLS (DW_VECS * VW)
#ifndef DW_TAP                  /* the window's reduction: a weighted sum unless a pool defines its own */
#define DW_INIT ((kiln_vf){0})
#define DW_TAP(acc, w, x) ((acc) + (w) * (x))
#define DW_WEIGHTS(b, c, w) kiln_b_col(ARGS, b, c, 0, KH * KW, w, 1)
#endif
void kiln_kernel(TASK_PARAMS) {
    const int threads = (double)BATCH * CIN * OH * OW * KH * KW > 65536.0 ? omp_get_max_threads() : 1;
#pragma omp parallel num_threads(threads)
    {
        float* planes = kiln_alloc(PLANE);
        for (int64_t e = SH * SW * HQ * WQ; e < PLANE; ++e) planes[e] = 0.f;
#pragma omp for schedule(static)
        for (int64_t u = 0; u < BATCH * CIN; ++u) {
            const int64_t b = u / CIN, c = u % CIN;
            float w[KH * KW];
            DW_WEIGHTS(b, c, w);
            kiln_fill(TASK_ARGS, b, c, planes);
            for (int64_t oh = 0; oh < OH; ++oh)
                for (int64_t ow0 = 0; ow0 < OW; ow0 += DW_COLS) {
                    kiln_vf acc[DW_VECS];
                    for (int v = 0; v < DW_VECS; ++v) acc[v] = DW_INIT;
                    for (int64_t i = 0; i < KH; ++i)
                        for (int64_t j = 0; j < KW; ++j) {
                            const float* src = planes + (i * DH % SH * SW + j * DW % SW) * (HQ * WQ)
                                               + (oh + i * DH / SH) * WQ + j * DW / SW + ow0;
                            const float wv = w[i * KW + j];
#pragma GCC unroll 8
                            for (int v = 0; v < DW_VECS; ++v) acc[v] = DW_TAP(acc[v], wv, *(const kiln_vfu*)(src + v * VW));
                        }
                    float row[DW_COLS] __attribute__((aligned(64)));
                    for (int v = 0; v < DW_VECS; ++v) *(kiln_vf*)(row + v * VW) = acc[v];
                    kiln_epilogue_row(ARGS, b, c, oh * OW + ow0, KILN_MIN(DW_COLS, OW - ow0), row);
                }
        }
        free(planes);
    }
}
"""

MAX_VECS = 4      # vectors of an output row's block (accumulators per tap)


def applies(task) -> bool:
    c = match_conv(task)
    return c is not None and c.depthwise


def render(task, DW_VECS: int = MAX_VECS) -> CpuProgram:
    """The program `kiln_kernel(inputs..., output)` for `task`: blocks of up to DW_VECS vectors
    of an output row (fewer where the row is shorter)."""
    c = match_conv(task)
    if c is None or not c.depthwise:
        raise ValueError(f"conv_depthwise_cpu does not apply to task '{task.name}'")
    return program(c, DW_VECS, {})


def program(c: ConvCpu, vectors: int, reduction: dict) -> CpuProgram:
    """The program of `c`, one channel per window, in blocks of up to `vectors` vectors of an
    output row, with the window's reduction's macros `reduction` (empty: the weighted sum)."""
    hq, wq = c.planes
    kw, dw, sw = c.kernel[1], c.dilation[1], c.stride[1]
    # a block reads up to DW_COLS + (kw - 1) * dw / sw floats from its row's start (16 floats: the widest vector)
    defines = {"PARAMS": "TASK_PARAMS", "ARGS": "TASK_ARGS", "DW_VECS": f"KILN_MIN({vectors}, (OW + VW - 1) / VW)",
               "PLANE": sw * c.stride[0] * hq * wq + 16 * vectors + (kw - 1) * dw // sw, **reduction}
    return CpuProgram(source(c, defines, FILL + KERNEL), "kiln_kernel", tuple(KernelArgs.args(len(c.lowered.inputs))))


def space(level: int) -> list[dict]:
    """Level 0: blocks of MAX_VECS vectors; higher levels also 2 and 8."""
    return [{"DW_VECS": MAX_VECS}] + ([{"DW_VECS": 2}, {"DW_VECS": 8}] if level >= 1 else [])


TEMPLATE = Template("conv_depthwise_cpu", ("conv2d",), "cpu", render, priority=20, applies=applies, space=space,
                    fixed_sizes_only=True)
