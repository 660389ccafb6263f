"""ATen neural-network operators: convolution and its backward (onto Kiln's convolutions and
transposed convolutions), layer norm and group norm with their statistics, softmax, pooling.

The gradients of a convolution are convolutions themselves. The input gradient is the
transposed convolution of the output gradient (with the output padding that restores the input
size), computed as a stride-1 convolution with the flipped, channel-swapped weight of the
output gradient spread out by the stride (zeros between its elements), so that it runs on the
convolution templates. The weight gradient is a correlation of the input with the output
gradient in which stride and dilation trade places, one per group.
"""
from __future__ import annotations

from kiln import dtypes, ops
from kiln.frontend.torch import register_function

from kiln_mappings_aten.common import aten, same_signature

same_signature("adaptive_avg_pool2d", aten._adaptive_avg_pool2d.default)
same_signature("adaptive_avg_pool3d", aten._adaptive_avg_pool3d.default)
same_signature("avg_pool2d", aten.avg_pool2d.default)
same_signature("avg_pool3d", aten.avg_pool3d.default)
same_signature("max_pool2d_with_indices", aten.max_pool2d_with_indices.default)
same_signature("max_pool3d_with_indices", aten.max_pool3d_with_indices.default)
same_signature("max_pool2d_with_indices_backward", aten.max_pool2d_with_indices_backward.default)
same_signature("max_pool3d_with_indices_backward", aten.max_pool3d_with_indices_backward.default)

_SPATIAL_DIMS = (1, 2, 3)


def _conv(nd: int):
    return getattr(ops, f"conv{nd}d")


def _conv_transpose(nd: int):
    return getattr(ops, f"conv_transpose{nd}d")


def _spatial(x, *args, **kwargs) -> bool:
    return x.ndim - 2 in _SPATIAL_DIMS


@register_function(aten.convolution.default, check=_spatial)
def convolution(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    nd = x.ndim - 2
    if transposed:
        return _conv_transpose(nd)(x, weight, bias, stride, padding, output_padding, groups,
                                   dilation)
    return _conv(nd)(x, weight, bias, stride, padding, dilation, groups)


def _correlation(a, b, kernel, stride, padding, dilation, groups: int):
    """Per group g, sum over batch and positions of a[n, i, p * stride - padding + k * dilation]
    * b[n, o, p]: shape (groups * b's channels per group, a's channels per group, *kernel). One
    convolution of `groups` groups for all of them, the batch as its channels (a's channels as
    its batch, b's as its filters): one node however many groups (a depthwise convolution's
    weight gradient was a convolution and a slice per channel, then a cat of them all)."""
    nd, n = a.ndim - 2, a.shape[0]
    ca, cb = a.shape[1] // groups, b.shape[1] // groups

    def channels_first(t, per_group, order):
        grouped = ops.reshape(t, (n, groups, per_group) + tuple(t.shape[2:]))
        return ops.permute(grouped, order + list(range(3, t.ndim + 1)))

    inputs = ops.reshape(channels_first(a, ca, [2, 1, 0]), (ca, groups * n) + tuple(a.shape[2:]))
    filters = ops.reshape(channels_first(b, cb, [1, 2, 0]), (groups * cb, n) + tuple(b.shape[2:]))
    full = _conv(nd)(inputs, filters, None, dilation, padding, stride, groups)
    for d, k in enumerate(kernel):
        if full.shape[2 + d] != k:
            full = ops.slice(full, 2 + d, 0, k)
    return ops.transpose(full, 0, 1)


def _flipped_transpose(weight, groups: int):
    """The weight of the convolution that is the transposed convolution of `weight` at stride 1:
    each group's input and output channels swapped, the kernel reversed in every spatial dim."""
    out, per_group = weight.shape[:2]
    kernel = tuple(weight.shape[2:])
    grouped = ops.reshape(weight, (groups, out // groups, per_group) + kernel)
    swapped = ops.reshape(ops.transpose(grouped, 1, 2), (groups * per_group, out // groups) + kernel)
    return ops.flip(swapped, list(range(2, weight.ndim)))


def _spread(grad, stride, extra):
    """`grad` with stride - 1 zeros between neighbours along each spatial dim and `extra` zeros
    after the last, so that a stride-1 convolution computes the strided one's transpose."""
    for d, (s, e) in enumerate(zip(stride, extra)):
        if s == 1 and e == 0:
            continue
        axis = 2 + d
        length = grad.shape[axis]
        spaced = ops.pad(ops.unsqueeze(grad, axis + 1), [0, 0] * (grad.ndim - axis - 1) + [0, s - 1])
        merged = ops.reshape(spaced, grad.shape[:axis] + (length * s,) + grad.shape[axis + 1:])
        grad = ops.slice(merged, axis, 0, (length - 1) * s + 1 + e)     # e < s
    return grad


@register_function(aten.convolution_backward.default, check=_spatial)
def convolution_backward(grad, x, weight, bias_sizes, stride, padding, dilation, transposed,
                         output_padding, groups, output_mask):
    """(input gradient, weight gradient, bias gradient), each None where output_mask says so."""
    nd = x.ndim - 2
    kernel = weight.shape[2:]
    grad_input = grad_weight = grad_bias = None
    if output_mask[0]:
        if transposed:
            grad_input = _conv(nd)(grad, weight, None, stride, padding, dilation, groups)
        else:
            restore = [x.shape[2 + d] - ((grad.shape[2 + d] - 1) * stride[d] - 2 * padding[d]
                                         + dilation[d] * (kernel[d] - 1) + 1) for d in range(nd)]
            border = [dilation[d] * (kernel[d] - 1) - padding[d] for d in range(nd)]
            if all(k == 1 for k in kernel) and not any(padding):
                # a 1x1 convolution maps each position to itself: its input gradient is the
                # stride-1 transpose's result spread out, rather than that convolution of the
                # spread gradient (a ResNet shortcut's at stride 2: a quarter of the products, and
                # no zero-filled gradient of the output's channels at the input's size)
                grad_input = _spread(_conv(nd)(grad, _flipped_transpose(weight, groups), None, 1, [0] * nd,
                                               dilation, groups), stride, restore)
            elif min(border) >= 0:
                grad_input = _conv(nd)(_spread(grad, stride, restore), _flipped_transpose(weight, groups),
                                       None, 1, border, dilation, groups)
            else:
                grad_input = _conv_transpose(nd)(grad, weight, None, stride, padding, restore, groups,
                                                 dilation)
    if output_mask[1]:
        inner, outer = (grad, x) if transposed else (x, grad)
        grad_weight = _correlation(inner, outer, kernel, stride, padding, dilation, groups)
    if output_mask[2]:
        grad_bias = ops.sum(grad, [0] + list(range(2, grad.ndim)))
    return grad_input, grad_weight, grad_bias


def _statistics_type(x):
    return dtypes.float32 if x.dtype.is_16bit_float else x.dtype


def _moments(x, dims: list[int], eps: float):
    """(x - mean, mean, 1 / sqrt(biased variance + eps)) of x over `dims` (kept), in float32
    for 16-bit x."""
    wide = ops.cast(x, _statistics_type(x))
    mean = ops.mean(wide, dims, True)
    centered = ops.sub(wide, mean)
    return centered, mean, ops.rsqrt(ops.add(ops.mean(ops.mul(centered, centered), dims, True), eps))


@register_function(aten.native_layer_norm.default)
def native_layer_norm(x, normalized_shape, weight, bias, eps):
    """(layer norm, mean, 1 / std), the statistics of shape x.shape[:axis] + (1,) * len(normalized_shape),
    float32 for 16-bit x on CUDA and x's dtype on the CPU, as eager gives them. The layer norm
    is computed from the statistics it returns (not by the layer_norm operator, which would
    compute them again), so that fusion makes the three one row kernel."""
    centered, mean, rstd = _moments(x, list(range(x.ndim - len(normalized_shape), x.ndim)), eps)
    out = ops.mul(centered, rstd)
    if weight is not None:
        out = ops.mul(out, weight)
    if bias is not None:
        out = ops.add(out, bias)
    if x.device.kind == "cpu":      # eager's CPU kernel rounds the statistics to x's dtype
        mean, rstd = ops.cast(mean, x.dtype), ops.cast(rstd, x.dtype)
    return ops.cast(out, x.dtype), mean, rstd


@register_function(aten.native_group_norm.default)
def native_group_norm(x, weight, bias, n, channels, hw, groups, eps):
    """(group norm, mean, 1 / std), the statistics of shape (N, groups) in x's dtype, as
    eager gives them."""
    _, mean, rstd = _moments(ops.reshape(x, (n, groups, channels // groups * hw)), [2], eps)
    statistic = lambda s: ops.cast(ops.reshape(s, (n, groups)), x.dtype)
    return ops.group_norm(x, groups, weight, bias, eps), statistic(mean), statistic(rstd)


def _softmax_rule(op: str):
    def rule(x, dim, half_to_float=False):
        return getattr(ops, op)(x, dim, dtypes.float32 if half_to_float else None)
    rule.__name__ = rule.__qualname__ = op
    return rule


softmax = register_function(aten._softmax.default)(_softmax_rule("softmax"))
log_softmax = register_function(aten._log_softmax.default)(_softmax_rule("log_softmax"))

def _floor_mode(grad, x, kernel_size, stride, padding, ceil_mode, count_include_pad,
                divisor_override) -> bool:
    return not ceil_mode and divisor_override is None and x.ndim in (3, 4)


@register_function(aten.avg_pool2d_backward.default, check=_floor_mode)
def avg_pool2d_backward(grad, x, kernel_size, stride, padding, ceil_mode, count_include_pad,
                        divisor_override):
    """Each output's gradient divided by its window's divisor, spread back over the window: a
    transposed convolution with a kernel of ones, per channel (floor mode only)."""
    kernel = (tuple(kernel_size) * 2)[:2] if len(kernel_size) == 1 else tuple(kernel_size)
    stride = kernel if not stride else ((tuple(stride) * 2)[:2] if len(stride) == 1 else tuple(stride))
    padding = (tuple(padding) * 2)[:2] if len(padding) == 1 else tuple(padding)
    size, out = x.shape[-2:], grad.shape[-2:]
    ones = ops.full((1, 1) + kernel, 1.0, dtype=grad.dtype, device=grad.device)
    if count_include_pad:
        scaled = ops.div(grad, kernel[0] * kernel[1])
    else:
        plane = ops.full((1, 1) + size, 1.0, dtype=grad.dtype, device=grad.device)
        counts = ops.reshape(ops.conv2d(plane, ones, None, stride, padding), out)
        scaled = ops.div(grad, counts)
    planes = ops.reshape(scaled, (-1, 1) + out)
    restore = [size[d] - ((out[d] - 1) * stride[d] - 2 * padding[d] + kernel[d]) for d in range(2)]
    spread = ops.conv_transpose2d(planes, ones, None, stride, padding, restore)
    return ops.reshape(spread, x.shape)
