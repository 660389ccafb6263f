"""conv2d on the CPU: an implicit GEMM on the micro-kernel, blocking and threads of `gemm_cpu`,
whose rows are output pixels and columns output channels; with groups, one GEMM per image and
group (its batches), each reading its group's planes and weight and writing its channels.

The input is first copied, once per call, into zero-padded *phase planes*: for strides
(SH, SW), plane (c, ph, pw) holds the padded input's rows ph, ph + SH, ... and columns pw,
pw + SW, ..., as float32 (16-bit inputs converted); only the phases that some tap reads (a
window one tap wide reads the first alone: a strided 1x1 convolution copies a quarter of its
input at stride 2, not all of it). An output pixel (oh, ow) then reads, for
kernel tap (i, j) of channel c, the plane (c, i*DH % SH, j*DW % SW) at row oh + i*DH / SH,
column ow + j*DW / SW: with pixels numbered oh * WQ + ow over the planes' width WQ ("virtual"
pixels: the columns ow >= OW are computed and dropped), each tap's values for consecutive
pixels are consecutive floats of one plane, at an offset that depends on the tap alone (a
table made once per call). So the micro-kernel reads A (pixels x taps) in place, with no
packing and no bounds test (`A_DIRECT` of `gemm_cpu`), and B (taps x output channels) is the
weight, read along k and packed by `gemm_cpu`'s register transposes. Where the register
tile's height divides the output's width (ResNet's and MobileNet's 112, 56, 28, 14 and 7),
the rows are the real pixels, each panel within one output row, read in place too: no extra
columns; and where the input is laid out as its planes would be (float32, stride 1, no
padding, the planes its size: a 1x1 convolution's), the planes are the input itself, not a
copy (`ConvCpu.input_is_planes`; with virtual pixels, whose last panel reads past an image's
planes, every image's but the last's). Otherwise, where the planes' extra columns would add a
quarter or more, the rows are real pixels and A's panels are gathered tap by tap. Padding,
stride and dilation are any; the output's (pixel, channel) tiles are transposed in registers
into a stage holding a B panel's channels over A's block of rows, which goes to the epilogue
hook a channel at a time, along consecutive pixels (bias, batch norm folded by the passes,
activations, residual adds: whatever fusion put there), so NCHW stores run along the output's
rows (all of the block's where the rows are real pixels). The weight, a constant, is laid out
in `gemm_cpu`'s panels once (`gemm_cpu.preparation`). 1x1 convolutions are plain GEMMs, `gemm_cpu.CONV`'s, except where
their output channels fill panels better than their pixels (`one_by_one_pays`).

The template takes a task only where its sum is exactly the conv2d definition's on two of its
inputs (`own_task.same_reduction`), with attributes from `task.attrs`; depthwise convolutions are
`conv_depthwise_cpu`'s, 3x3 ones of stride 1 mostly `conv_winograd_cpu`'s. Its sizes are fixed
(a kernel per size): a model traced with symbolic sizes keeps `gemm_cpu.CONV`, built once for
every size.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from kiln.template import (CDialect, CpuProgram, Emitter, KernelArgs, Load, Task, Template, TensorInput, Var, cast,
                           c_template_source, device_code, dtypes, inline_task, row_major_strides, simplify,
                           top_reduces, unravel_index, walk)

from kiln_ops_builtin.common import int_tuple
from kiln_ops_builtin.conv import conv2d
from kiln_ops_builtin.templates import gemm_cpu
from kiln_ops_builtin.templates.cpu_hooks import FACTOR_DTYPES, calls_libm, render_epilogue_row, reports_failures
from kiln_ops_builtin.templates.own_task import same_reduction

# The device code (`cpu/*.h`): the planes, which pixels the rows are, `gemm_cpu`'s micro-kernel,
# A's panels and tiles from the planes, `gemm_cpu`'s blocking, the kernel.
KERNEL = (("cpu/simd.h", "cpu/common.h", "cpu/planes.h", "cpu/conv_rows.h", "cpu/micro.h", "cpu/conv.h")
          + gemm_cpu.BLOCK + ("cpu/conv_main.h",))


@dataclass
class ConvCpu:
    """A conv2d (or sliding-window pool) task's sizes and its operands among the task's inputs."""

    lowered: object                  # the task after inlining
    x: TensorInput
    weight: TensorInput | None       # None for a pool
    stride: tuple[int, int]
    dilation: tuple[int, int]
    before: tuple[int, int]          # padding added before the first row and column
    out_shape: tuple[int, ...]       # (N, O, OH, OW)
    depthwise: bool                  # one group per channel, as many output channels
    kernel: tuple[int, int]          # the window's (KH, KW)
    groups: int = 1                  # the convolution's groups (a depthwise one's too)

    @property
    def planes(self) -> tuple[int, int]:
        """(HQ, WQ): the rows and columns of a phase plane (what the output reads, rounded up)."""
        (sh, sw), (dh, dw) = self.stride, self.dilation
        kh, kw = self.kernel
        oh, ow = self.out_shape[2:]
        return -(-((oh - 1) * sh + (kh - 1) * dh + 1) // sh), -(-((ow - 1) * sw + (kw - 1) * dw + 1) // sw)

    @property
    def weight_input(self) -> int:
        """The weight's index among the task's inputs."""
        return next(k for k, t in enumerate(self.lowered.inputs) if t is self.weight)

    @property
    def x_input(self) -> int:
        """The input's index among the task's inputs."""
        return next(k for k, t in enumerate(self.lowered.inputs) if t is self.x)

    @property
    def input_is_planes(self) -> bool:
        """Whether the input is laid out as its phase planes would be (float32, one phase of
        stride 1, no padding, the planes its size: a 1x1 convolution's of stride 1), so that
        they may be the input itself (`cpu/conv_rows.h`'s IN_PLACE)."""
        return (self.x.dtype == dtypes.float32 and self.stride == (1, 1) and self.before == (0, 0)
                and self.planes == tuple(self.x.shape[2:]))

    @property
    def gather(self) -> bool:
        """Whether the GEMM's rows are real pixels, whose A panels are gathered tap by tap: where
        the planes' extra columns would add a quarter or more to the work (ResNet's 7x7
        layers: 9 / 7; measured on ResNet-18's layers, the gathers cost about a seventh); else
        rows are virtual pixels, read in place."""
        return self.planes[1] >= 1.25 * self.out_shape[3]

    def defines(self) -> dict:
        """The C macros of the sizes, the parameters and the planes (`cpu/planes.h` uses them,
        padding them with PAD); GROUPS (1 here) is what a kernel runs as GEMM batches,
        GROUP_COUT a group's output channels."""
        d = CDialect()
        lowered = self.lowered
        (n, cin, h, w), (kh, kw) = self.x.shape, self.kernel
        hq, wq = self.planes
        return {"TASK_PARAMS": ", ".join(KernelArgs.params(d, lowered.inputs, lowered.outputs)),
                "TASK_ARGS": ", ".join(KernelArgs.args(len(lowered.inputs))), "BATCH": n, "IMAGES": n, "GROUPS": 1,
                "GROUP_COUT": self.out_shape[1], "CIN": cin, "H": h, "W": w,
                "KH": kh, "KW": kw, "SH": self.stride[0], "SW": self.stride[1], "DH": self.dilation[0],
                "DW": self.dilation[1], "PH": self.before[0], "PW": self.before[1], "OH": self.out_shape[2],
                "OW": self.out_shape[3], "HQ": hq, "WQ": wq, "PAD": "0.f"}


def _padding_before(padding, kernel, dilation) -> tuple[int, int] | None:
    if padding == "valid":
        return 0, 0
    if padding == "same":
        return tuple(d * (k - 1) // 2 for d, k in zip(dilation, kernel))
    try:
        return int_tuple("conv2d", "padding", padding, 2)
    except (ValueError, TypeError):      # int_tuple's OperatorError is a ValueError
        return None


def windowed(task: Task, op: str, reads: int) -> tuple | None:
    """(the task inlined, the tensors its reduction reads, the reduction) where `task` has one
    4-D output of fixed shape around one reduction `op` that reads `reads` 4-D float inputs of
    fixed shapes, else None."""
    lowered = inline_task(task)
    if len(lowered.buffers) != 1 or len(lowered.outputs) != 1:
        return None
    out = lowered.outputs[0]
    if len(out.shape) != 4 or not all(isinstance(s, int) for s in out.shape):
        return None
    reduces = top_reduces(out.value)
    if len(reduces) != 1 or reduces[0].op != op:
        return None
    read = list({id(e.tensor): e.tensor for e in walk(reduces[0].body) if isinstance(e, Load)}.values())
    if len(read) != reads or not all(isinstance(t, TensorInput) and t.ndim == 4 and t.dtype in FACTOR_DTYPES
                                     and all(isinstance(s, int) for s in t.shape) for t in read):
        return None
    return lowered, read, reduces[0]


def match_conv(task: Task) -> ConvCpu | None:
    """`task` as a conv2d of a 4-D float input (epilogues fused around its sum), any groups
    (`depthwise` where there are as many as input and output channels), or None."""
    attrs = task.attrs
    if task.name != "conv2d" or not isinstance(attrs.get("groups"), int) or not {"stride", "padding", "dilation"} <= set(attrs):
        return None
    groups = attrs["groups"]
    found = windowed(task, "sum", 2)
    if found is None or found[2].dtype != dtypes.float32:
        return None
    lowered, read, _ = found
    out = lowered.outputs[0]
    if reports_failures(out.value):
        return None
    for x, weight in (read, read[::-1]):
        try:
            ref = conv2d.definition(x=x, weight=weight, bias=None, stride=attrs["stride"], padding=attrs["padding"],
                                    dilation=attrs["dilation"], groups=groups)
        except (ValueError, TypeError):      # an OperatorError is a ValueError
            continue
        if not same_reduction([x, weight], out, ref):
            continue
        stride, dilation = int_tuple("conv2d", "stride", attrs["stride"], 2), int_tuple("conv2d", "dilation", attrs["dilation"], 2)
        before = _padding_before(attrs["padding"], weight.shape[2:], dilation)
        if before is None:
            return None
        depthwise = groups > 1 and groups == x.shape[1] == out.shape[1]
        return ConvCpu(lowered, x, weight, stride, dilation, before, tuple(out.shape), depthwise, weight.shape[2:], groups)
    return None


def applies(task) -> bool:
    """Convolutions with kernels larger than 1x1 (depthwise ones aside), grouped 1x1 ones (a
    plain GEMM's rows would be single output channels: the group is in the B factor's index),
    and the ungrouped 1x1 ones that run better here than as `gemm_cpu.CONV`'s plain GEMMs
    (`one_by_one_pays`)."""
    c = match_conv(task)
    return c is not None and not c.depthwise and (c.weight.shape[2:] != (1, 1) or c.groups > 1 or one_by_one_pays(c))


def one_by_one_pays(c: ConvCpu) -> bool:
    """Whether a 1x1 convolution goes here rather than to the plain GEMM, whose columns are its
    pixels in panels of 32 (AVX-512's): where it has at least 192 input channels (the tile's
    transposition and the epilogue are paid per output element, whatever K) and its output
    channels pad whole panels no more than its pixels do. Measured on MobileNetV2's layers with
    their fused epilogues: its projections to 7 x 7 and 14 x 14 (K of 192 to 960) 1.25-1.6x
    faster here, its expansions (K of 64 to 160) 1.15-1.6x slower. Not where the plain GEMM writes
    its planes with A's panels outer (at stride 1, planes of at least
    `gemm_cpu.ROWS_OUTER_PIXELS`) from an input larger than L2 (`gemm_cpu.L2_BYTES`) that this
    template would copy into planes (not `ConvCpu.input_is_planes`: a 16-bit one). With the
    tiles staged (a block's runs through the epilogue at once), an input read in place goes here
    even with its channels a page apart or more (each a page of its own): ResNet-50 b8's
    256 -> 64 and 256 -> 128 at 56 x 56, whose planes of 32 x 98 pixels pad no panel (one thread
    on an AVX2 EPYC: 13.4 -> 10.6 and 22.2 -> 19.6 ms); its 128 -> 512 at 28 x 28 (K 128) stays
    with the plain GEMM (9.4 ms there, 10.2 here)."""
    padded = lambda n: -(-n // 32) * 32 / n
    plane = c.out_shape[2] * c.out_shape[3]
    large = plane >= gemm_cpu.ROWS_OUTER_PIXELS and math.prod(c.x.shape) * 4 > gemm_cpu.L2_BYTES
    if c.stride == (1, 1) and large and not c.input_is_planes:
        return False
    return c.x.shape[1] // c.groups >= 192 and padded(c.out_shape[1] // c.groups) <= padded(plane)


def _hooks(c: ConvCpu) -> str:
    """C of `kiln_x` (an input element in float), `kiln_b_col` (the weight along k for output
    channel n; none for a pool) and `kiln_epilogue_row` (channel m, pixels n0 .. n0 + count - 1,
    flat over OH x OW)."""
    out = c.lowered.outputs[0]
    names = KernelArgs.names(c.lowered.inputs)
    strides = {id(t): row_major_strides(t.shape) for t in c.lowered.inputs}
    b, ch, h, w = (Var(name, extent) for name, extent in zip("bchw", c.x.shape))
    em = Emitter(CDialect(), {**names, id(b): "b", id(ch): "c", id(h): "h", id(w): "w"}, strides)
    v = em.emit(simplify(cast(Load(c.x, (b, ch, h, w)), dtypes.float32)))
    hooks = [f"static inline float kiln_x(TASK_PARAMS, int64_t b, int64_t c, int64_t h, int64_t w) {{\n"
             + "\n".join(em.lines) + f"\n    return {v};\n}}\n",
             "" if c.weight is None else _weight_hook(c, names, strides)]
    bv, mv, nv = Var("b", out.shape[0]), Var("m", out.shape[1]), Var("n", out.shape[2] * out.shape[3])
    index = {id(out.axes[0]): bv, id(out.axes[1]): mv, **unravel_index(nv, out.axes[2:], out.shape[2:])}
    hooks.append(render_epilogue_row(c.lowered, out, index, {id(bv): "b", id(mv): "m", id(nv): "n"}, "PARAMS"))
    return "".join(hooks)


def _weight_hook(c: ConvCpu, names: dict, strides: dict) -> str:
    """C of `kiln_b_col`: the weight along k (taps) for output channel n of GEMM batch b's group
    (output channel b % GROUPS * GROUP_COUT + n)."""
    taps = c.weight.shape[1:]
    o, k = Var("o", c.weight.shape[0]), Var("k", math.prod(taps))
    tap_axes = [Var(f"t{i}", e) for i, e in enumerate(taps)]
    index = unravel_index(k, tap_axes, taps)
    em = Emitter(CDialect(), {**names, id(o): "o", id(k): "k"}, strides, indent=2)
    v = em.emit(simplify(cast(Load(c.weight, (o, *(index[id(a)] for a in tap_axes))), dtypes.float32)))
    return ("static inline void kiln_b_col(PARAMS, int64_t b, int64_t n, int64_t k0, int64_t count, "
            "float* __restrict__ dst, int64_t stride) {\n"
            "    const int64_t o = b % GROUPS * GROUP_COUT + n;\n"
            "    for (int64_t k = k0; k < k0 + count; ++k) {\n" + "\n".join(em.lines)
            + f"\n        dst[(k - k0) * stride] = {v};\n    }}\n}}\n")


def source(c: ConvCpu, defines: dict, paths: tuple[str, ...], entries: str = "") -> str:
    """C source of a convolution program: `c.defines()` and `defines` as macros, the hooks, the
    device code `paths` (files of this package), then `entries`."""
    return c_template_source([device_code(__package__, *paths), entries], {**c.defines(), **defines}, _hooks(c))


def prepared_program(c: ConvCpu, defines: dict, paths: tuple[str, ...], main: str, prepare: str) -> CpuProgram:
    """The program of a convolution template on `gemm_cpu`'s pieces (`source(c, defines,
    paths)`) whose C functions `main(<task's buffers>, bpre)` and `prepare(<task's buffers>,
    bpre, dst)` compute the convolution and lay its constant weight out once
    (`gemm_cpu.entry_points`, `gemm_cpu.preparation`)."""
    inputs = c.lowered.inputs
    args = KernelArgs.args(len(inputs))
    entries = gemm_cpu.entry_points(KernelArgs.params(CDialect(), inputs, c.lowered.outputs), args, [], [], main,
                                    prepare)
    return CpuProgram(source(c, defines, paths, entries), "kiln_kernel", tuple(args),
                      preparation=gemm_cpu.preparation(c.weight_input, len(inputs)))


ALIGNED_ROWS = (14, 12, 8, 7)     # register-tile heights (16-float vectors) that may divide an output row


def row_height(c: ConvCpu) -> int:
    """The register tile's height with 16-float vectors: the tallest of ALIGNED_ROWS that
    divides the output's width (each panel of rows then lies in one output row: A is read in
    place with no extra columns), else `gemm_cpu.row_tile` of the rows computed. With K up to
    SHORT_K, 8 rows where 8 divides the width: the epilogue then runs on whole 8-float vectors,
    where 14 rows leave 6 elements to scalar code, which costs as much as the products when K
    is small and fusion put a ReLU's max there (MobileNetV2's stem: 0.90 -> 0.40 ms)."""
    k = c.x.shape[1] // c.groups * c.kernel[0] * c.kernel[1]
    heights = (8,) + ALIGNED_ROWS if k <= SHORT_K else ALIGNED_ROWS
    aligned = [r for r in heights if c.out_shape[3] % r == 0]
    row = c.out_shape[3] if c.gather else c.planes[1]
    return aligned[0] if aligned else gemm_cpu.row_tile(c.out_shape[2] * row)


SHORT_K = 512


@dataclass(frozen=True)
class ConvKnobs(gemm_cpu.GemmKnobs):
    """`gemm_cpu.GemmKnobs` with A's blocks half as tall by default, 168 rows (12 panels of 14
    pixels): measured on ResNet-50 b8's 1x1 layers of 1024 input channels at 14 x 14 (four K
    blocks) about 7% faster than 336 rows, its other layers here unchanged; B's panels (the
    weights) not prefetched ahead (B_PREFETCH, measured on the linear layers only)."""

    MC: int = 168
    B_PREFETCH: int = 0


def render(task, **knobs) -> CpuProgram:
    """The program `kiln_kernel(inputs..., output)` for `task` at the setting `knobs`
    (`ConvKnobs`' fields). The rows are real pixels where MR divides the output's width
    (`cpu/conv_rows.h`'s ALIGNED), else as `gather` says."""
    c = match_conv(task)
    if c is None or c.depthwise:
        raise ValueError(f"conv_cpu does not apply to task '{task.name}'")
    knob = ConvKnobs(**knobs)
    cout, group_cin, kh, kw = c.weight.shape
    k = group_cin * kh * kw
    defines = {"GROUPS": c.groups, "GROUP_COUT": cout // c.groups, "BATCH": c.x.shape[0] * c.groups,
               "B_GROUPS": c.groups, "PARAMS": f"TASK_PARAMS, {gemm_cpu.BPRE}, const float* __restrict__ planes, "
                         "const int64_t* __restrict__ koffs",
               "ARGS": "TASK_ARGS, bpre, planes, koffs",
               "PLANE_TAIL": (kw - 1) * c.dilation[1] // c.stride[1] + 16, "INPUT_PLANES": KernelArgs.input(c.x_input),
               "INPUT_PLANES_OK": int(c.input_is_planes),
               "GATHER": int(c.gather), "N": cout // c.groups, "K": k, "B_BY_K": 1, "EPILOGUE_LIBM": int(calls_libm(task)),
               **gemm_cpu.block_knobs(knob, k), "MR_WIDE": row_height(c)}
    # K blocks of whole input channels: `cpu/micro.h` reads a channel's taps at fixed offsets
    defines["KC"] = max(kh * kw, defines["KC"] // (kh * kw) * (kh * kw))
    return prepared_program(c, defines, KERNEL, "kiln_conv", "kiln_conv_prepare")


TEMPLATE = Template("conv_cpu", ("conv2d",), "cpu", render, priority=20, applies=applies,
                    space=ConvKnobs.settings, fixed_sizes_only=True)
