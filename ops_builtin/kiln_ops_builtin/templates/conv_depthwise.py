"""Depthwise conv2d (groups == in channels == out channels), any float dtype.

A block of NT threads computes a TH x TW tile of one output plane (one image, one channel):
it first copies the input window the tile reads (zero outside the image: the padding) and the
channel's filter into shared memory, converted to the accumulator type (float32 for 16-bit and
32-bit floats), then each thread computes RPT outputs of one column, rows NT / TW apart, from
shared memory. Outputs go through the core's epilogue hook (bias, activation, cast), with GEMM
row m the plane (image x channel) and column n the output pixel.

Applies to kernels up to 7 x 7, strides 1 and 2, no dilation, and reads the input and filter
straight from the task's inputs (a prologue fused into them declines the template). The output
may be a permutation of the convolution's (a fused permute, as in channels-last blocks): which
output axis is the image, the channel, the row and the column is read from the loads' index
expressions, never from the output's shape, and the template declines any other index form (a
fused slice, a broadcast, a squeezed dimension).

The device code is `cuda/conv_depthwise.cuh` (the knobs as `kiln::conv_depthwise::Tile`, the
convolution as `Shape`) and `cuda/conv_depthwise_kernel.cuh` (the kernel, on them); between the
two this module renders `kiln_conv_depthwise_program`: the knobs, the shape, the accumulator
type and how the input and the filter are read. Knobs: `DepthwiseKnobs`.
"""
from __future__ import annotations

from dataclasses import dataclass

from kiln.template import (CudaDialect, CudaProgram, KernelArgs, Knobs, Launch, Load, Select, Template, Var,
                           device_code, inline_task, linear_terms, render_epilogue, strip_cast, template_source,
                           top_reduces, unravel_index)

NT = 128
MAX_KERNEL = 7

# What cuda/conv_depthwise_kernel.cuh's kernel reads of a program: the knobs
# (kiln::conv_depthwise::Tile), the convolution (Shape), the accumulator type, the input and
# filter parameters and how an element of them is read.
PROGRAM = """
struct kiln_conv_depthwise_program {{
    using Tile = kiln::conv_depthwise::Tile<{nt}, {tw}, {rpt}>;
    using Shape = kiln::conv_depthwise::Shape<{c}, {h}, {w}, {oh}, {ow}, {kh}, {kw}, {sh}, {sw}, {ph}, {pw}>;
    using Acc = {acc};
    static __device__ __forceinline__ auto x({params}) {{ return {x}; }}
    static __device__ __forceinline__ auto w({params}) {{ return {wt}; }}
    template <typename V>
    static __device__ __forceinline__ auto load(V v) {{ return {load}; }}
}};
"""


@dataclass(frozen=True)
class DepthwiseKnobs(Knobs):
    """Tiles TW columns wide, each thread computing RPT outputs of one column (both 0: `auto_tile`'s
    for the plane)."""

    TW: int = 0
    RPT: int = 0

    def valid(self) -> bool:
        return (self.TW, self.RPT) == (0, 0) or (self.TW > 0 and NT % self.TW == 0 and self.RPT >= 1)

    @classmethod
    def space(cls, level: int) -> list[DepthwiseKnobs]:
        """Level 0: tile from the plane's size; levels 1 and 2 add fixed tiles."""
        out = [cls()]
        if level >= 1:
            out += [cls(TW=32, RPT=4), cls(TW=16, RPT=2)]
        if level >= 2:
            out += cls.grid(TW=(8, 16, 32), RPT=(1, 2, 4))
        return out


def _pair(value, what: str) -> tuple[int, int]:
    value = tuple(value) if isinstance(value, (tuple, list)) else (value, value)
    if len(value) != 2 or not all(isinstance(v, int) for v in value):
        raise ValueError(f"conv_depthwise: {what} {value!r} is not an int pair")
    return value


def _direct_loads(task):
    """(lowered task, x's Load, weight's Load) when the task's sum is of x * weight read straight
    from its inputs, padding select included; None otherwise."""
    lowered = inline_task(task)
    if len(lowered.buffers) != 1 or len(lowered.outputs) != 1:
        return None
    reduces = top_reduces(lowered.outputs[0].value)
    if len(reduces) != 1 or reduces[0].op != "sum":
        return None
    body = strip_cast(reduces[0].body)
    if isinstance(body, Select):
        body = strip_cast(body.a)
    if getattr(body, "op", None) != "mul":
        return None
    x, w = strip_cast(body.a), strip_cast(body.b)
    inputs = {id(t) for t in lowered.inputs}
    if not (isinstance(x, Load) and isinstance(w, Load)) or not {id(x.tensor), id(w.tensor)} <= inputs:
        return None
    return lowered, x, w


def _terms(index, zero) -> tuple[dict, int] | None:
    """{variable: coefficient} and constant of a linear index expression, the variables of
    `zero` (reduction axes of extent 1) left out; None when a term is not a variable."""
    terms, constant = linear_terms(index)
    coefficients: dict = {}
    for term, k in terms:
        if not isinstance(term, Var):
            return None
        if term not in zero:
            coefficients[term] = coefficients.get(term, 0) + k
    return {v: k for v, k in coefficients.items() if k}, constant


def _output_axis(terms, extra: dict, stride: int, constant: int, axes):
    """The output axis `a` of terms {a: stride, **extra} + constant (None where the index has
    no output axis, which an extent of 1 allows); False for any other form."""
    if terms is None or terms[1] != constant:
        return False
    coefficients = dict(terms[0])
    if any(coefficients.pop(v, 0) != k for v, k in extra.items()):
        return False
    if not coefficients:
        return None
    if len(coefficients) != 1:
        return False
    (axis, k), = coefficients.items()
    return axis if k == stride and any(axis is a for a in axes) else False


def _roles(out, x: Load, w: Load, reduce_axes, strides, pads) -> tuple | None:
    """The output axes that are the convolution's image, channel, row and column, each a Var of
    `out` or None (extent 1, absent), when the loads read x[image, channel, row * SH - PH + kh,
    column * SW - PW + kw] and w[channel, 0, kh, kw] and `out` has no other axis of extent > 1;
    else None."""
    zero = {a for a in reduce_axes if a.extent == 1}
    wt = [_terms(i, zero) for i in w.indices]
    if any(t is None for t in wt) or wt[1] != ({}, 0) or any(t[1] for t in wt):
        return None
    window = []
    for t in wt[2:]:
        if len(t[0]) > 1 or any(k != 1 or v not in reduce_axes for v, k in t[0].items()):
            return None
        window.append(t[0])
    if len(reduce_axes) - len(zero) != sum(map(len, window)):
        return None
    xt = [_terms(i, zero) for i in x.indices]
    roles = [_output_axis(xt[0], {}, 1, 0, out.axes), _output_axis(xt[1], {}, 1, 0, out.axes),
             _output_axis(xt[2], window[0], strides[0], -pads[0], out.axes),
             _output_axis(xt[3], window[1], strides[1], -pads[1], out.axes)]
    if any(r is False for r in roles) or wt[0][0] != ({roles[1]: 1} if roles[1] is not None else {}):
        return None
    used = [r for r in roles if r is not None]
    if len({id(r) for r in used}) != len(used):
        return None
    if any(e != 1 and not any(a is r for r in used) for a, e in zip(out.axes, out.shape)):
        return None
    return tuple(roles)


def _extent(axis) -> int:
    return 1 if axis is None else axis.extent


def _geometry(task):
    """(N, C, H, W, KH, KW, SH, SW, PH, PW, roles) of a depthwise conv2d task, roles being the
    output axes of image, channel, row and column (see `_roles`), or None."""
    a = task.attrs
    found = _direct_loads(task)
    if found is None or a.get("groups", 1) == 1:
        return None
    lowered, x, w = found
    if len(x.tensor.shape) != 4 or len(w.tensor.shape) != 4:
        return None
    n, c, h, wd = x.tensor.shape
    oc, one, kh, kw = w.tensor.shape
    if not (a["groups"] == c == oc and one == 1 and kh <= MAX_KERNEL and kw <= MAX_KERNEL):
        return None
    if _pair(a.get("dilation", 1), "dilation") != (1, 1):
        return None
    sh, sw = _pair(a.get("stride", 1), "stride")
    padding = a.get("padding", 0)
    if padding == "valid":
        padding = 0
    elif padding == "same":
        padding = ((kh - 1) // 2, (kw - 1) // 2)
    ph, pw = _pair(padding, "padding")
    if sh not in (1, 2) or sw not in (1, 2):
        return None
    out = lowered.outputs[0]
    reduce = top_reduces(out.value)[0]
    roles = _roles(out, x, w, reduce.axes, (sh, sw), (ph, pw))
    if roles is None or (_extent(roles[0]), _extent(roles[1])) != (n, c):
        return None
    return n, c, h, wd, kh, kw, sh, sw, ph, pw, roles


def applies(task) -> bool:
    try:
        return _geometry(task) is not None
    except (ValueError, KeyError):
        return False


def auto_tile(oh: int, ow: int) -> tuple[int, int]:
    """(TW, RPT): tile columns as narrow as the plane allows, rows per thread to cover it (at most 4)."""
    tw = 8 if ow <= 8 else 16 if ow <= 16 else 32
    return tw, min(4, max(1, -(-oh // (NT // tw))))


def render(task, **knobs) -> CudaProgram:
    """The program of `task` at the setting `knobs` (`DepthwiseKnobs`' fields)."""
    k = DepthwiseKnobs(**knobs)
    n, c, h, w, kh, kw, sh, sw, ph, pw, roles = _geometry(task)
    lowered, x, wt = _direct_loads(task)
    out = lowered.outputs[0]
    oh, ow = _extent(roles[2]), _extent(roles[3])
    TW, RPT = (k.TW, k.RPT) if k.TW else auto_tile(oh, ow)
    th = NT // TW * RPT
    d = CudaDialect()
    acc = top_reduces(out.value)[0].dtype
    names = KernelArgs.names(lowered.inputs)
    decl = KernelArgs.params(d, lowered.inputs, [out])
    args = KernelArgs.args(len(lowered.inputs))

    def index_of(bvar, mvar, nvar):
        planes = [(r, _extent(r)) for r in roles[:2] if r is not None]
        pixels = [(r, _extent(r)) for r in roles[2:] if r is not None]
        return {**unravel_index(mvar, [r for r, _ in planes], [e for _, e in planes]),
                **unravel_index(nvar, [r for r, _ in pixels], [e for _, e in pixels])}

    epilogue = render_epilogue(lowered, out, decl, index_of, False)
    program = PROGRAM.format(nt=NT, tw=TW, rpt=RPT, c=c, h=h, w=w, oh=oh, ow=ow, kh=kh, kw=kw, sh=sh, sw=sw, ph=ph,
                             pw=pw, acc=d.value_type(acc), params=", ".join(decl), x=names[id(x.tensor)],
                             wt=names[id(wt.tensor)], load=d.load(x.tensor.dtype, "(v)"))
    # the epilogue hook's (the kernel reads them too)
    defines = {"PARAMS": ", ".join(decl), "ARGS": ", ".join(args)}
    grid = (n * c, -(-oh // th), -(-ow // TW))
    launch = Launch("kiln_conv_depthwise", tuple(args), (NT, 1, 1), grid=grid)
    kernels = [device_code(__package__, "cuda/conv_depthwise.cuh"), program,
               device_code(__package__, "cuda/conv_depthwise_kernel.cuh")]
    return CudaProgram(template_source(kernels, defines, epilogue), [launch])


TEMPLATE = Template("conv_depthwise", ("conv2d",), "cuda", render, priority=20, applies=applies,
                    space=DepthwiseKnobs.settings)
