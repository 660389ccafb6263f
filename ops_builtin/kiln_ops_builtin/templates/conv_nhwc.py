"""Recognizing a channels-last 2-D convolution in a task, fused epilogue and all.

`conv2d_channels_last` (and a fused group anchored on it) computes

    out[b, oy, ox, o] = epilogue(sum over (ry, rx, c) of
        select(in bounds, x[b, oy*sh - ph + ry*dh, ox*sw - pw + rx*dw, g(o) + c], 0) * weight[o, ry, rx, c])

where g(o) = o // (out_channels / groups) * (channels / groups) is the first input channel of
o's group (0 without groups).

`match_conv_nhwc` reads the geometry back from the lowered task's IR (not from operator
attributes, so a fused task is read the same way), and only where x and the weight are plain
loads of task inputs: a prologue fused into an operand (an activation, a pad) makes it decline,
since the templates built on it copy the operands raw. The window indices must be affine in
(output pixel, tap) with no division; the in-bounds guard is checked against the geometry at the
edges and inside of the output and kernel windows, and a grouped convolution's channel index
at the edges of the groups.
"""
from __future__ import annotations

from dataclasses import dataclass

from kiln.template import (Binary, Const, DataType, Expr, HookedGemm, KernelArgs, Load, Select, Task, Var, as_expr,
                           gemm_factors, inline_task, match_hooked_gemm, simplify, strip_cast, substitute, top_reduces,
                           variables_of, walk)


@dataclass(frozen=True)
class ConvNHWC:
    """A channels-last convolution x (batch, height, width, channels) * weight (out_channels, kh,
    kw, channels / groups) -> (batch, out_h, out_w, out_channels). Without groups it is the GEMM
    M = batch * out_h * out_w pixels, N = out_channels, K = kh * kw * channels in (ry, rx, c)
    order, and `gemm` holds its load and epilogue hooks (None for a grouped convolution). `x` and
    `weight` are the kernel argument names of the operands; `channels_innermost`: the output's
    innermost axis is the output channel (no permute fused into the epilogue)."""

    batch: int
    height: int
    width: int
    channels: int
    out_channels: int
    kh: int
    kw: int
    out_h: int
    out_w: int
    stride: tuple[int, int]
    padding: tuple[int, int]
    dilation: tuple[int, int]
    x: str
    weight: str
    dtype: DataType
    groups: int
    channels_innermost: bool
    gemm: HookedGemm | None

    @property
    def is_gemm(self) -> bool:
        """A 1x1, stride-1, unpadded convolution: x viewed as [pixels, channels] is A itself."""
        return ((self.kh, self.kw, self.stride, self.padding) == (1, 1, (1, 1), (0, 0))
                and (self.height, self.width) == (self.out_h, self.out_w))


def match_conv_nhwc(task: Task) -> ConvNHWC | None:
    """The channels-last convolution `task` computes, or None (matched once per task)."""
    return task.derived(_match)


def _value(e: Expr, env: dict) -> int | None:
    v = simplify(substitute(e, {id(var): as_expr(val) for var, val in env.items()}))
    return v.value if isinstance(v, Const) else None


def _affine_only(e: Expr) -> bool:
    return all(isinstance(x, (Var, Const)) or (isinstance(x, Binary) and x.op in ("add", "sub", "mul"))
               for x in walk(e))


def _window(index: Expr, out_var: Var, tap: Var, out_size: int, taps: int):
    """(stride, padding, dilation) of `index` = out * stride - padding + tap * dilation, or None.
    A single output position or tap leaves its stride or dilation free (a fused task's
    simplified index may drop its variable): it is taken as 1."""
    if not _affine_only(index) or not variables_of(index) <= {id(out_var), id(tap)}:
        return None
    base, one_out, one_tap = (_value(index, {out_var: o, tap: t}) for o, t in ((0, 0), (1, 0), (0, 1)))
    if None in (base, one_out, one_tap):
        return None
    stride = one_out - base if out_size > 1 else 1
    dilation, padding = one_tap - base if taps > 1 else 1, -base
    last = _value(index, {out_var: out_size - 1, tap: taps - 1})
    if last != (out_size - 1) * stride - padding + (taps - 1) * dilation or stride < 1 or dilation < 1 or padding < 0:
        return None
    return stride, padding, dilation


def _samples(size: int, taps: int) -> list[tuple[int, int]]:
    outs = sorted({o for o in (0, 1, size // 2, size - 2, size - 1) if 0 <= o < size})
    return [(o, t) for o in outs for t in sorted({0, taps // 2, taps - 1})]


def _guard_ok(cond, vars_y, vars_x, geo_y, geo_x, size_y, size_x) -> bool:
    """Whether the guard `cond` (None: no guard) is the in-bounds test of the window at the
    sampled output positions and taps (and, unguarded, whether no tap can leave the input)."""
    (oy, ry, out_h, kh), (ox, rx, out_w, kw) = vars_y, vars_x

    def inside(geo, size, o, t):
        return 0 <= o * geo[0] - geo[1] + t * geo[2] < size

    if cond is None:
        return all(inside(g, s, o, t) for g, s, o, t in ((geo_y, size_y, 0, 0), (geo_y, size_y, out_h - 1, kh - 1),
                                                          (geo_x, size_x, 0, 0), (geo_x, size_x, out_w - 1, kw - 1)))
    if not variables_of(cond) <= {id(oy), id(ry), id(ox), id(rx)}:
        return False
    ys, xs = _samples(out_h, kh), _samples(out_w, kw)
    y_in = [p for p in ys if inside(geo_y, size_y, *p)]
    x_in = [p for p in xs if inside(geo_x, size_x, *p)]
    if not y_in or not x_in:
        return False
    checks = [(p, x_in[0], inside(geo_y, size_y, *p)) for p in ys] + [(y_in[0], p, inside(geo_x, size_x, *p)) for p in xs]
    checks += [(p, q, False) for p in ys[:1] + ys[-1:] for q in xs[:1] + xs[-1:]
               if not (inside(geo_y, size_y, *p) and inside(geo_x, size_x, *q))]
    return all(_value(cond, {oy: y[0], ry: y[1], ox: x[0], rx: x[1]}) == int(want) for y, x, want in checks)


def _group_start_ok(ic: Expr, oc: Var, rc: Var, out_channels: int, group_in: int, group_out: int) -> bool:
    """Whether input channel index `ic` is oc // group_out * group_in + rc at the edges of the
    groups (`rc` a reduction axis of extent group_in)."""
    if not variables_of(ic) <= {id(oc), id(rc)}:
        return False
    outs = {o for g in (0, 1, out_channels // group_out // 2, out_channels // group_out - 1)
            for o in (g * group_out, g * group_out + group_out - 1) if 0 <= o < out_channels}
    return all(_value(ic, {oc: o, rc: c}) == o // group_out * group_in + c
               for o in sorted(outs) for c in sorted({0, group_in - 1}))


def _match(task: Task) -> ConvNHWC | None:
    lowered = inline_task(task)
    if len(lowered.buffers) != 1 or len(lowered.outputs) != 1:
        return None
    out = lowered.outputs[0]
    reduces = top_reduces(out.value)
    if len(reduces) != 1 or reduces[0].op != "sum" or len(reduces[0].axes) != 3:
        return None
    r = reduces[0]
    factors = gemm_factors(strip_cast(r.body), {id(a) for a in out.axes})
    if factors is None:
        return None
    for fx, fw in (factors, factors[::-1]):
        cond = None
        if isinstance(fx, Select) and isinstance(fx.b, Const) and fx.b.value == 0:
            cond, fx = fx.cond, fx.a
        xl, wl = strip_cast(fx), strip_cast(fw)
        if isinstance(xl, Load) and isinstance(wl, Load) and len(xl.indices) == 4 and len(wl.indices) == 4:
            break
    else:
        return None
    ry, rx, rc = r.axes
    params = KernelArgs.names(lowered.inputs)
    if id(xl.tensor) not in params or id(wl.tensor) not in params or xl.tensor.dtype != wl.tensor.dtype:
        return None
    uses_w = variables_of(fw)
    n_axes = [a for a in out.axes if id(a) in uses_w]
    m_axes = [a for a in out.axes if id(a) not in uses_w]
    if len(n_axes) != 1 or len(m_axes) != 3 or list(wl.indices) != [n_axes[0], ry, rx, rc]:
        return None
    (batch, height, width, channels), (out_channels, kh, kw, wc) = xl.tensor.shape, wl.tensor.shape
    shape = dict(zip(map(id, out.axes), out.shape))
    (b, oy, ox), (out_h, out_w) = m_axes, (shape[id(m_axes[1])], shape[id(m_axes[2])])
    ib, iy, ix, ic = xl.indices
    groups = channels // wc
    if (channels % wc or out_channels % groups or shape[id(b)] != batch or shape[id(n_axes[0])] != out_channels
            or not (ib is b or (isinstance(ib, Const) and ib.value == 0 and batch == 1))):
        return None
    if not (ic is rc if groups == 1 else _group_start_ok(ic, n_axes[0], rc, out_channels, wc, out_channels // groups)):
        return None
    geo_y, geo_x = _window(iy, oy, ry, out_h, kh), _window(ix, ox, rx, out_w, kw)
    if geo_y is None or geo_x is None or not _guard_ok(cond, (oy, ry, out_h, kh), (ox, rx, out_w, kw), geo_y, geo_x,
                                                       height, width):
        return None
    gemm = match_hooked_gemm(task) if groups == 1 else None
    if groups == 1 and (gemm is None or (gemm.M, gemm.N, gemm.K) != (batch * out_h * out_w, out_channels,
                                                                     kh * kw * channels)):
        return None
    return ConvNHWC(batch, height, width, channels, out_channels, kh, kw, out_h, out_w, (geo_y[0], geo_x[0]),
                    (geo_y[1], geo_x[1]), (geo_y[2], geo_x[2]), params[id(xl.tensor)], params[id(wl.tensor)],
                    xl.tensor.dtype, groups, out.axes[-1] is n_axes[0], gemm)
