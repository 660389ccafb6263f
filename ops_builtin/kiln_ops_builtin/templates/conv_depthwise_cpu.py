"""Depthwise conv2d on the CPU (one group per channel: MobileNet's 3x3 convolutions), vectorized
along the output's rows.

Threads take (batch, channel) pairs. Each copies its channel into zero-padded phase planes
(`cpu/planes.h`: for stride s, plane (ph, pw) holds the padded input's rows ph, ph + s, ...
and columns pw, pw + s, ...), so that for every kernel tap the inputs of consecutive output
columns are consecutive floats of one plane, for any stride, padding and dilation. An output
row is then computed in blocks of DW_VECS vectors: per tap, one broadcast weight times
unaligned loads of the plane, no bounds tests (columns past the row are computed from the
planes' zeros or the next row and not stored). Blocks are staged, up to 4096 floats of whole
output rows, which go through the epilogue hook as one run (bias, folded batch norm, ReLU6,
residual add: whatever fusion put there): MobileNetV2's rows of 7 and 14 pixels, handed over a
row at a time, left most of their pixels to the hook's scalar code (its model 0.91x the time at
one thread on an AVX2 EPYC with the stage). 16-bit inputs are converted to float32 as the planes
are filled, and accumulate in float32. Sizes are fixed, as `conv_cpu`'s. The device code is
`cpu/depthwise.h`; its knob DW_MAX swaps the weighted sum for a max, so that `pool_cpu` runs
max-pools on it.
"""
from __future__ import annotations

from dataclasses import dataclass

from kiln.template import CpuProgram, KernelArgs, Knobs, Template

from kiln_ops_builtin.templates.conv_cpu import ConvCpu, match_conv, source

KERNEL = ("cpu/simd.h", "cpu/common.h", "cpu/planes.h", "cpu/depthwise.h")     # the device code (`cpu/*.h`)


@dataclass(frozen=True)
class DepthwiseKnobs(Knobs):
    """Blocks of up to DW_VECS vectors of an output row (accumulators per tap)."""

    DW_VECS: int = 4

    def valid(self) -> bool:
        return 1 <= self.DW_VECS <= 16

    @classmethod
    def space(cls, level: int) -> list[DepthwiseKnobs]:
        """Level 0: blocks of 4 vectors; higher levels also 2 and 8."""
        return [cls()] + ([cls(DW_VECS=2), cls(DW_VECS=8)] if level >= 1 else [])


def applies(task) -> bool:
    c = match_conv(task)
    return c is not None and c.depthwise


def render(task, **knobs) -> CpuProgram:
    """The program `kiln_kernel(inputs..., output)` for `task` at the setting `knobs`
    (`DepthwiseKnobs`' fields)."""
    c = match_conv(task)
    if c is None or not c.depthwise:
        raise ValueError(f"conv_depthwise_cpu does not apply to task '{task.name}'")
    return program(c, DepthwiseKnobs(**knobs), False)


def program(c: ConvCpu, knobs: DepthwiseKnobs, window_max: bool) -> CpuProgram:
    """The program of `c`, one channel per window, at the setting `knobs`: the window's weighted
    sum, or its max where `window_max` (the planes then padded with -inf)."""
    hq, wq = c.planes
    kw, dw, sw = c.kernel[1], c.dilation[1], c.stride[1]
    # a block reads up to DW_COLS + (kw - 1) * dw / sw floats from its row's start (16 floats: the widest vector)
    defines = {"PARAMS": "TASK_PARAMS", "ARGS": "TASK_ARGS", "DW_VECS": knobs.DW_VECS, "DW_MAX": int(window_max),
               "PLANE": sw * c.stride[0] * hq * wq + 16 * knobs.DW_VECS + (kw - 1) * dw // sw,
               **({"PAD": "(-INFINITY)"} if window_max else {})}
    return CpuProgram(source(c, defines, KERNEL), "kiln_kernel", tuple(KernelArgs.args(len(c.lowered.inputs))))


TEMPLATE = Template("conv_depthwise_cpu", ("conv2d",), "cpu", render, priority=20, applies=applies,
                    space=DepthwiseKnobs.settings, fixed_sizes_only=True)
