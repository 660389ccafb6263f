"""Normalizations composed from reductions: instance_norm, batch_norm over the batch's own
statistics (training=True without running statistics), local_response_norm and weight
normalization (torch._weight_norm, as nn.utils.weight_norm computes it)."""
import math

import torch
import torch.nn.functional as F
from torch import nn

from kiln import ops
from kiln.frontend.torch import KilnModule, register_function, register_module


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


def _normalized(input, dims, weight, bias, eps):
    """(input - mean) / sqrt(biased variance + eps) over `dims`, then the per-channel (dim 1)
    affine; 16-bit inputs take their statistics in float32, as PyTorch does."""
    x = ops.cast(input, "float32") if input.dtype.is_16bit_float else input
    mean = ops.mean(x, dims, True)
    centered = ops.sub(x, mean)
    y = ops.mul(centered, ops.rsqrt(ops.add(ops.mean(ops.mul(centered, centered), dims, True), eps)))
    channel = (input.shape[1],) + (1,) * (input.ndim - 2)
    if weight is not None:
        y = ops.mul(y, ops.reshape(weight, channel))
    if bias is not None:
        y = ops.add(y, ops.reshape(bias, channel))
    return ops.cast(y, input.dtype)


def _batch_statistics(input, running_mean, running_var, weight=None, bias=None, training=False,
                      momentum=0.1, eps=1e-5) -> bool:
    """training=True with no running statistics to update (weight standardization, NFNet,
    BatchNorm with track_running_stats=False), and more than one value per channel (else
    PyTorch raises)."""
    return (training and running_mean is None and running_var is None and input.ndim >= 2
            and math.prod(input.shape) // max(input.shape[1], 1) > 1)


@register_function(F.batch_norm, check=_batch_statistics)
def batch_norm_batch_statistics(input, running_mean, running_var, weight=None, bias=None,
                                training=False, momentum=0.1, eps=1e-5):
    """Each channel normalized by its mean and biased variance over (N, *spatial), as eager
    computes them in training mode (a pure function of the input: no running statistics)."""
    return _normalized(input, [0] + list(range(2, input.ndim)), weight, bias, eps)


@register_module(nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d,
                 check=lambda m, x: not m.track_running_stats and math.prod(x.shape) // x.shape[1] > 1)
class BatchNormBatchStatistics(KilnModule):
    """A batch norm without running statistics normalizes by the batch's own, in eval mode too."""

    def __call__(self, x):
        return _normalized(x, [0] + list(range(2, x.ndim)), self.param("weight", optional=True),
                           self.param("bias", optional=True), self.torch_module.eps)


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
