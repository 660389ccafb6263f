"""Max pooling in training graphs saves one int8 offset an output, not int64 positions and the
input, for its backward.

Autograd's gradient of `max_pool2d` takes the int64 positions of the maxima and the input
itself (for its size only), so that AOTAutograd's partitioner saves both: for ResNet-50's stem at
batch 32, the positions (51 MB) and the ReLU output that the pool reads (51 MB, which it may not
recompute, a non-fusible op of the backward reading it). Kiln's decomposition of
`aten.max_pool2d` (taking the place of torch's composite above autograd, as the plugins'
decompositions do in Kiln's traces) computes it with `kiln::max_pool2d_with_offsets`, which
returns the values and the int8 offset of each maximum within its window (Kiln's
`max_pool2d_with_offsets`), and whose gradient `kiln::max_pool2d_offsets_backward` needs the
offsets and the input's size alone. It applies to windows of at most 127 elements. Outside
Kiln's traces both operators run with torch's max-pool kernels.
"""
from __future__ import annotations

import math

import torch

from kiln.frontend.torch import register_decomposition

from kiln_mappings_aten.common import aten, same_signature

MAX_WINDOW = 127        # elements an int8 offset names


def _pair(v) -> list[int]:
    return [v, v] if isinstance(v, int) else list(v) * (2 // len(v))


def _window_starts(pooled_shape, stride, padding, device):
    """The row (as a column) and the column (as a row) of each window's first element."""
    (oh, ow), (sh, sw), (ph, pw) = pooled_shape[-2:], stride, padding
    rows = (torch.arange(oh, device=device) * sh - ph).view(-1, 1)
    cols = (torch.arange(ow, device=device) * sw - pw).view(1, -1)
    return rows, cols


@torch.library.custom_op("kiln::max_pool2d_with_offsets", mutates_args=())
def max_pool2d_with_offsets(x: torch.Tensor, kernel_size: list[int], stride: list[int], padding: list[int],
                            dilation: list[int], ceil_mode: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(max_pool2d's values, the int8 offset of each maximum within its window, row-major)."""
    values, indices = aten.max_pool2d_with_indices.default(x, kernel_size, stride, padding, dilation, ceil_mode)
    rows, cols = _window_starts(indices.shape, stride, padding, x.device)
    (_, kw), (dh, dw), width = kernel_size, dilation, x.shape[-1]
    offsets = ((indices // width - rows) // dh) * kw + (indices % width - cols) // dw
    return values, offsets.to(torch.int8)


@max_pool2d_with_offsets.register_fake
def _(x, kernel_size, stride, padding, dilation, ceil_mode):
    values, _ = aten.max_pool2d_with_indices.default(x, kernel_size, stride, padding, dilation, ceil_mode)
    return values, torch.empty_like(values, dtype=torch.int8)


@torch.library.custom_op("kiln::max_pool2d_offsets_backward", mutates_args=())
def max_pool2d_offsets_backward(grad: torch.Tensor, offsets: torch.Tensor, input_size: list[int],
                                kernel_size: list[int], stride: list[int], padding: list[int], dilation: list[int],
                                ceil_mode: bool) -> torch.Tensor:
    """The input gradient of `max_pool2d_with_offsets`'s values."""
    rows, cols = _window_starts(offsets.shape, stride, padding, grad.device)
    (_, kw), (dh, dw) = kernel_size, dilation
    o = offsets.long()
    indices = (rows + o // kw * dh) * input_size[-1] + cols + o % kw * dw
    x = grad.new_empty(input_size)
    return aten.max_pool2d_with_indices_backward.default(grad, x, kernel_size, stride, padding, dilation,
                                                         ceil_mode, indices)


@max_pool2d_offsets_backward.register_fake
def _(grad, offsets, input_size, kernel_size, stride, padding, dilation, ceil_mode):
    return grad.new_empty(input_size)


def _save(ctx, inputs, output):
    x, ctx.kernel_size, ctx.stride, ctx.padding, ctx.dilation, ctx.ceil_mode = inputs
    ctx.input_size = list(x.shape)
    ctx.save_for_backward(output[1])


def _backward(ctx, grad, _offsets_grad):
    offsets, = ctx.saved_tensors
    return (max_pool2d_offsets_backward(grad, offsets, ctx.input_size, ctx.kernel_size, ctx.stride, ctx.padding,
                                        ctx.dilation, ctx.ceil_mode), None, None, None, None, None)


max_pool2d_with_offsets.register_autograd(_backward, setup_context=_save)


@register_decomposition(aten.max_pool2d.default)
def max_pool2d(x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    kernel = _pair(kernel_size)
    args = (kernel, _pair(stride) if stride else kernel, _pair(padding), _pair(dilation), ceil_mode)
    if math.prod(kernel) > MAX_WINDOW or x.dim() not in (3, 4) or not x.dtype.is_floating_point:
        return aten.max_pool2d_with_indices.default(x, *args)[0]
    return max_pool2d_with_offsets(x, *args)[0]


same_signature("max_pool2d_with_offsets", torch.ops.kiln.max_pool2d_with_offsets.default)
same_signature("max_pool2d_offsets_backward", torch.ops.kiln.max_pool2d_offsets_backward.default)
