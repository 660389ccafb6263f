"""Inference batch_norm folded into the preceding conv2d or linear layer.

`batch_norm(conv2d(x, w, b), mean, var, gamma, beta)` is `conv2d(x, w * s, (b - mean) * s + beta)`
per output channel, with `s = gamma / sqrt(var + eps)`; the new weight and bias are computed
now, from the constants, on their device.
"""
from __future__ import annotations

import torch

from kiln.passes.pattern import constant, op, rewrite_pattern, wildcard
from kiln.tensor import from_torch


def _folded(m, layer, bn, channel_shape):
    """The layer's node re-created with the batch norm folded in, or None."""
    args, norm = m.args(layer), m.args(bn)
    tensors = [args["weight"], args.get("bias"), norm["running_mean"], norm["running_var"],
               norm.get("weight"), norm.get("bias")]
    if any(t is not None and t.is_symbolic for t in tensors):
        return None
    weight, bias, mean, var, gamma, beta = [None if t is None else t.torch().double() for t in tensors]
    scale = torch.rsqrt(var + norm["eps"])
    if gamma is not None:
        scale = scale * gamma
    shift = -mean * scale if bias is None else (bias - mean) * scale
    if beta is not None:
        shift = shift + beta
    dtype = args["weight"].dtype.torch_dtype
    args["weight"] = from_torch((weight * scale.reshape(channel_shape)).to(dtype).contiguous())
    args["bias"] = from_torch(shift.to(dtype).contiguous())
    return m[layer].definition(**args)


_x = wildcard()
_conv = op("conv2d", _x, constant())
_conv_bn = op("batch_norm", _conv, constant(), constant())
_linear = op("linear", _x, constant(), where=lambda n: n.outputs[0].ndim == 2)
_linear_bn = op("batch_norm", _linear, constant(), constant())


@rewrite_pattern("fold_conv2d_batch_norm", _conv_bn)
def fold_conv2d_batch_norm(m):
    """conv2d followed by inference batch_norm: one conv2d with folded weight and bias."""
    return _folded(m, _conv, _conv_bn, (-1, 1, 1, 1))


@rewrite_pattern("fold_linear_batch_norm", _linear_bn)
def fold_linear_batch_norm(m):
    """linear (2-D output) followed by inference batch_norm: one linear with folded parameters."""
    return _folded(m, _linear, _linear_bn, (-1, 1))


BATCH_NORM_PATTERNS = (fold_conv2d_batch_norm, fold_linear_batch_norm)
