"""Direct convolutions: conv1d, conv2d, conv3d and their transposes, as
torch.nn.functional defines them, and fold (col2im, the sum of overlapping patches).

Inputs are (N, C, *spatial) or unbatched (C, *spatial). Each output element sums x * weight
over the input channels of its group and the kernel window; zero padding is a select on the
bounds, so out-of-range elements are never read. 16-bit floats accumulate in float32.
"""
from kiln import dtypes
from kiln.graph import TF32, OperatorError, Traits, operator
from kiln.ir import cast, compute, eq, reduce, select

from kiln_ops_builtin.common import (
    accumulator_type, check_dtype, check_spatial_input, in_bounds, int_tuple,
)


def _out_channels(op: str, x, weight, bias, groups: int, nd: int, transposed: bool) -> int:
    """Validate the operands; return the number of output channels."""
    for t in (x, weight) if bias is None else (x, weight, bias):
        check_dtype(op, t, dtypes.FLOATS)
    if len({t.dtype for t in (x, weight, bias) if t is not None}) > 1:
        raise OperatorError(f"{op}: input, weight and bias must have one dtype, got "
                            f"{x.dtype}, {weight.dtype}" + ("" if bias is None else f", {bias.dtype}"))
    check_spatial_input(op, x, nd)
    if weight.ndim != nd + 2:
        raise OperatorError(f"{op}: expected a {nd + 2}-D weight, got shape {weight.shape}")
    if not isinstance(groups, int) or groups < 1:
        raise OperatorError(f"{op}: groups must be a positive int, got {groups!r}")
    channels = x.shape[-nd - 1]
    if transposed:
        if weight.shape[0] != channels:
            raise OperatorError(f"{op}: input has {channels} channels but weight {weight.shape} "
                                f"expects {weight.shape[0]}")
        out_channels = weight.shape[1] * groups
    else:
        if weight.shape[1] * groups != channels:
            raise OperatorError(f"{op}: input has {channels} channels but weight {weight.shape} with "
                                f"groups={groups} expects {weight.shape[1] * groups}")
        out_channels = weight.shape[0]
    if channels % groups or out_channels % groups:
        raise OperatorError(f"{op}: groups={groups} must divide the input channels ({channels}) "
                            f"and the output channels ({out_channels})")
    if bias is not None and bias.shape != (out_channels,):
        raise OperatorError(f"{op}: bias of shape {bias.shape} does not match {out_channels} output channels")
    return out_channels


def _steps(op: str, nd: int, stride, dilation) -> tuple[tuple[int, ...], tuple[int, ...]]:
    stride, dilation = int_tuple(op, "stride", stride, nd), int_tuple(op, "dilation", dilation, nd)
    if min(stride + dilation) < 1:
        raise OperatorError(f"{op}: stride {stride} and dilation {dilation} must be positive")
    return stride, dilation


def _window_sums(op: str, x, weight, bias, groups: int, out_channels: int, out_spatial,
                 transposed: bool, tap):
    """The output compute. `tap(o, r)` gives, for the spatial output index `o` and kernel
    offset `r`, the condition for a contribution and the input position it reads."""
    if any(s <= 0 for s in out_spatial):
        raise OperatorError(f"{op}: input of shape {x.shape} gives an empty output {tuple(out_spatial)}")
    nd = len(out_spatial)
    batch, kernel = x.shape[:-nd - 1], weight.shape[2:]
    cin, cout = x.shape[-nd - 1] // groups, out_channels // groups
    nb, acc = len(batch), accumulator_type(x.dtype)

    def element(*idx):
        b, oc, o = idx[:nb], idx[nb], idx[nb + 1:]

        def term(c, *r):
            ic = oc // cout * cin + c
            cond, pos = tap(o, r)
            w = weight[(ic, oc % cout) + r] if transposed else weight[(oc, c) + r]
            return select(cond, cast(x[b + (ic,) + tuple(pos)], acc) * cast(w, acc), 0)

        total = reduce([cin, *kernel], term, dtype=acc)
        return total if bias is None else total + cast(bias[oc], acc)

    return compute(batch + (out_channels,) + tuple(out_spatial), element, dtype=x.dtype)


def _conv(op: str, nd: int, x, weight, bias, stride, padding, dilation, groups):
    out_channels = _out_channels(op, x, weight, bias, groups, nd, transposed=False)
    kernel, size = weight.shape[2:], x.shape[-nd:]
    stride, dilation = _steps(op, nd, stride, dilation)
    if padding == "valid":
        before = after = (0,) * nd
    elif padding == "same":
        if stride != (1,) * nd:
            raise OperatorError(f"{op}: padding='same' is not supported for strided convolutions "
                                f"(stride {stride})")
        total = [d * (k - 1) for d, k in zip(dilation, kernel)]
        before = tuple(t // 2 for t in total)
        after = tuple(t - b for t, b in zip(total, before))
    elif isinstance(padding, str):
        raise OperatorError(f"{op}: padding must be 'same', 'valid', an int or {nd} ints, got {padding!r}")
    else:
        before = after = int_tuple(op, "padding", padding, nd)
        if min(before) < 0:
            raise OperatorError(f"{op}: padding {before} must be non-negative")
    out_spatial = [(n + b + a - d * (k - 1) - 1) // s + 1
                   for n, b, a, d, k, s in zip(size, before, after, dilation, kernel, stride)]

    def tap(o, r):
        pos = [o[d] * stride[d] - before[d] + r[d] * dilation[d] for d in range(nd)]
        return in_bounds(pos, size), pos

    return _window_sums(op, x, weight, bias, groups, out_channels, out_spatial, False, tap)


def _conv_transpose(op: str, nd: int, x, weight, bias, stride, padding, output_padding, groups, dilation):
    out_channels = _out_channels(op, x, weight, bias, groups, nd, transposed=True)
    kernel, size = weight.shape[2:], x.shape[-nd:]
    stride, dilation = _steps(op, nd, stride, dilation)
    padding = int_tuple(op, "padding", padding, nd)
    output_padding = int_tuple(op, "output_padding", output_padding, nd)
    if min(padding + output_padding) < 0:
        raise OperatorError(f"{op}: padding {padding} and output_padding {output_padding} "
                            "must be non-negative")
    if any(p >= s and p >= d for p, s, d in zip(output_padding, stride, dilation)):
        raise OperatorError(f"{op}: output_padding {output_padding} must be smaller than either "
                            f"stride {stride} or dilation {dilation}")
    out_spatial = [(n - 1) * s - 2 * p + d * (k - 1) + q + 1
                   for n, s, p, d, k, q in zip(size, stride, padding, dilation, kernel, output_padding)]

    def tap(o, r):
        # output o receives input i through kernel offset r where i * stride = o + padding - r * dilation
        offset = [o[d] + padding[d] - r[d] * dilation[d] for d in range(nd)]
        pos = [offset[d] // stride[d] for d in range(nd)]
        cond = in_bounds(pos, size)
        for d in range(nd):
            if stride[d] > 1:
                cond = cond & eq(offset[d] % stride[d], 0)
        return cond, pos

    return _window_sums(op, x, weight, bias, groups, out_channels, out_spatial, True, tap)


@operator("conv1d")
def conv1d(x, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    """torch.nn.functional.conv1d; padding is an int, a 1-tuple, 'valid' or 'same'."""
    return _conv("conv1d", 1, x, weight, bias, stride, padding, dilation, groups)


@operator("conv2d", traits=Traits(channels_last="conv2d_channels_last", tf32=TF32.CONVOLUTION))
def conv2d(x, weight, bias=None, stride=1, padding=0, dilation=1, groups=1, allow_tf32=False):
    """torch.nn.functional.conv2d; padding is an int, a pair, 'valid' or 'same'. `allow_tf32`:
    a GPU template may round float32 operands to TF32 (as cuDNN under
    `torch.backends.cudnn.allow_tf32`); the values defined do not change."""
    return _conv("conv2d", 2, x, weight, bias, stride, padding, dilation, groups)


@operator("conv_transpose1d")
def conv_transpose1d(x, weight, bias=None, stride=1, padding=0, output_padding=0, groups=1, dilation=1):
    """torch.nn.functional.conv_transpose1d, weight of shape (C_in, C_out / groups, kW)."""
    return _conv_transpose("conv_transpose1d", 1, x, weight, bias, stride, padding, output_padding,
                           groups, dilation)


@operator("conv_transpose2d")
def conv_transpose2d(x, weight, bias=None, stride=1, padding=0, output_padding=0, groups=1, dilation=1):
    """torch.nn.functional.conv_transpose2d, weight of shape (C_in, C_out / groups, kH, kW)."""
    return _conv_transpose("conv_transpose2d", 2, x, weight, bias, stride, padding, output_padding,
                           groups, dilation)


@operator("conv3d")
def conv3d(x, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    """torch.nn.functional.conv3d; padding is an int, a triple, 'valid' or 'same'."""
    return _conv("conv3d", 3, x, weight, bias, stride, padding, dilation, groups)


@operator("conv_transpose3d")
def conv_transpose3d(x, weight, bias=None, stride=1, padding=0, output_padding=0, groups=1, dilation=1):
    """torch.nn.functional.conv_transpose3d, weight of shape (C_in, C_out / groups, kD, kH, kW)."""
    return _conv_transpose("conv_transpose3d", 3, x, weight, bias, stride, padding, output_padding,
                           groups, dilation)


@operator("conv2d_channels_last", traits=Traits(tf32=TF32.CONVOLUTION))
def conv2d_channels_last(x, weight, bias=None, stride=1, padding=0, dilation=1, groups=1, allow_tf32=False):
    """conv2d on channels-last data: x of shape (N, H, W, C), weight (O, kH, kW, C / groups),
    result (N, OH, OW, O); padding is an int or a pair; `allow_tf32` as conv2d's.

    The layout pass (`kiln.passes.layout`) runs convolution-heavy regions through it. Its
    reduction runs over (kernel row, kernel column, channel), the memory order of both
    operands, so a template sees a GEMM whose K is contiguous in A and B alike.
    """
    op = "conv2d_channels_last"
    for t in (x, weight) if bias is None else (x, weight, bias):
        check_dtype(op, t, dtypes.FLOATS)
    if len({t.dtype for t in (x, weight, bias) if t is not None}) > 1:
        raise OperatorError(f"{op}: input, weight and bias must have one dtype")
    if x.ndim != 4 or weight.ndim != 4:
        raise OperatorError(f"{op}: expected a 4-D input (N, H, W, C) and weight (O, kH, kW, C / groups), "
                            f"got {x.shape} and {weight.shape}")
    if not isinstance(groups, int) or groups < 1:
        raise OperatorError(f"{op}: groups must be a positive int, got {groups!r}")
    (n, h, w, channels), (out_channels, kh, kw, cin) = x.shape, weight.shape
    if cin * groups != channels or out_channels % groups:
        raise OperatorError(f"{op}: input of {channels} channels, weight {weight.shape} and groups={groups} "
                            "do not match")
    if bias is not None and bias.shape != (out_channels,):
        raise OperatorError(f"{op}: bias of shape {bias.shape} does not match {out_channels} output channels")
    stride, dilation = _steps(op, 2, stride, dilation)
    pad = int_tuple(op, "padding", padding, 2)
    if min(pad) < 0:
        raise OperatorError(f"{op}: padding {pad} must be non-negative")
    out_spatial = [(size + 2 * p - d * (k - 1) - 1) // s + 1
                   for size, p, d, k, s in zip((h, w), pad, dilation, (kh, kw), stride)]
    if min(out_spatial) <= 0:
        raise OperatorError(f"{op}: input of shape {x.shape} gives an empty output {tuple(out_spatial)}")
    cout, acc = out_channels // groups, accumulator_type(x.dtype)

    def element(b, oy, ox, oc):
        def term(ry, rx, c):
            pos = [oy * stride[0] - pad[0] + ry * dilation[0], ox * stride[1] - pad[1] + rx * dilation[1]]
            value = cast(x[b, pos[0], pos[1], oc // cout * cin + c], acc) * cast(weight[oc, ry, rx, c], acc)
            return select(in_bounds(pos, (h, w)), value, 0)

        total = reduce([kh, kw, cin], term, dtype=acc)
        return total if bias is None else total + cast(bias[oc], acc)

    return compute((n, *out_spatial, out_channels), element, dtype=x.dtype)


@operator("fold")
def fold(x, output_size, kernel_size, dilation=1, padding=0, stride=1):
    """torch.nn.functional.fold (col2im): x of shape (N, C * kH * kW, L) or unbatched
    (C * kH * kW, L), L sliding blocks, to (N, C, H, W) or (C, H, W). Each output pixel sums the
    block entries that cover it (in float32 for 16-bit floats), in a fixed order: deterministic,
    no atomics."""
    op = "fold"
    check_dtype(op, x, dtypes.FLOATS)
    if x.ndim not in (2, 3):
        raise OperatorError(f"{op}: expected a 2-D (unbatched) or 3-D input, got shape {x.shape}")
    (h, w), (kh, kw) = int_tuple(op, "output_size", output_size, 2), int_tuple(op, "kernel_size", kernel_size, 2)
    stride, dilation = _steps(op, 2, stride, dilation)
    (ph, pw), (sh, sw), (dh, dw) = int_tuple(op, "padding", padding, 2), stride, dilation
    if min(kh, kw) < 1 or min(ph, pw) < 0:
        raise OperatorError(f"{op}: kernel_size {(kh, kw)} must be positive and padding {(ph, pw)} non-negative")
    blocks_h, blocks_w = (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1, (w + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    rows, length = x.shape[-2:]
    if rows % (kh * kw) or min(blocks_h, blocks_w) < 1 or length != blocks_h * blocks_w:
        raise OperatorError(f"{op}: input of shape {x.shape} does not hold C * {kh * kw} rows of "
                            f"{max(blocks_h, 0) * max(blocks_w, 0)} blocks for output_size {(h, w)}, "
                            f"kernel_size {(kh, kw)}, dilation {dilation}, padding {(ph, pw)}, stride {stride}")
    batch, acc = tuple(x.shape[:-2]), accumulator_type(x.dtype)

    def element(*idx):
        b, c, y, xx = idx[:-3], idx[-3], idx[-2], idx[-1]

        def entry(i, j):
            # the block (by, bx) whose entry (i, j) lands on (y, xx): by * sh - ph + i * dh == y
            offset = (y + ph - i * dh, xx + pw - j * dw)
            pos = (offset[0] // sh, offset[1] // sw)
            cond = in_bounds(pos, (blocks_h, blocks_w))
            for o, s_ in zip(offset, (sh, sw)):
                if s_ > 1:
                    cond = cond & eq(o % s_, 0)
            return select(cond, cast(x[b + ((c * kh + i) * kw + j, pos[0] * blocks_w + pos[1])], acc), 0)

        return reduce([kh, kw], entry, dtype=acc)

    return compute(batch + (rows // (kh * kw), h, w), element, dtype=x.dtype)
