"""Normalizations composed from reductions: instance_norm, local_response_norm and weight
normalization (torch._weight_norm, as nn.utils.weight_norm computes it)."""
import torch
import torch.nn.functional as F

from kiln import ops
from kiln.frontend.torch import register_function


def _statistics_only(input, running_mean=None, running_var=None, weight=None, bias=None,
                     use_input_stats=True, momentum=0.1, eps=1e-5, cudnn_enabled=False) -> bool:
    return use_input_stats


@register_function(F.instance_norm, check=_statistics_only)
def instance_norm(input, running_mean=None, running_var=None, weight=None, bias=None,
                  use_input_stats=True, momentum=0.1, eps=1e-5):
    """Each (sample, channel) normalized over its spatial dims, then the per-channel affine."""
    dims = tuple(range(2, input.ndim))
    mean = ops.mean(input, dims, True)
    centered = ops.sub(input, mean)
    var = ops.mean(ops.mul(centered, centered), dims, True)
    y = ops.mul(centered, ops.rsqrt(ops.add(var, eps)))
    channel = (input.shape[1],) + (1,) * (input.ndim - 2)
    if weight is not None:
        y = ops.mul(y, ops.reshape(weight, channel))
    if bias is not None:
        y = ops.add(y, ops.reshape(bias, channel))
    return y


@register_function(F.local_response_norm)
def local_response_norm(input, size, alpha=1e-4, beta=0.75, k=1.0):
    """x / (k + alpha / size * sum of x^2 over `size` neighbouring channels) ** beta."""
    square = ops.mul(input, input)
    before, after = size // 2, (size - 1) // 2
    padded = ops.pad(square, [0, 0] * (input.ndim - 2) + [before, after])
    total = None
    for s in range(size):
        window = ops.slice(padded, 1, s, s + input.shape[1])
        total = window if total is None else ops.add(total, window)
    return ops.div(input, ops.pow(ops.add(ops.mul(total, alpha / size), k), beta))


@register_function(torch._weight_norm)
def weight_norm(v, g, dim=0):
    """g * v / ||v||, the norm over every dim but `dim` (all dims for dim -1)."""
    if dim == -1:
        norm = ops.sqrt(ops.sum(ops.mul(v, v)))
    else:
        d = dim % v.ndim
        norm = ops.sqrt(ops.sum(ops.mul(v, v), [k for k in range(v.ndim) if k != d], True))
    return ops.mul(v, ops.div(g, norm))


@register_function(torch.native_layer_norm)
def native_layer_norm(input, normalized_shape, weight, bias, eps):
    """(layer_norm, mean, rstd), the statistics of shape input.shape[:axis] + (1,) * len(normalized_shape)."""
    dims = list(range(input.ndim - len(normalized_shape), input.ndim))
    mean = ops.mean(input, dims, True)
    centered = ops.sub(input, mean)
    rstd = ops.rsqrt(ops.add(ops.mean(ops.mul(centered, centered), dims, True), eps))
    out = ops.layer_norm(input, tuple(normalized_shape), weight, bias, eps)
    return out, mean, rstd
