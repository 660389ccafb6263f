"""Kiln's own decompositions of ATen overloads in training graphs, in place of torch's.

`_log_softmax` is x - logsumexp(x), computed in float32 for 16-bit inputs: one statistic per
row (torch's decomposition subtracts the row max and the log of the sum of exps, two), which a
row kernel computes alone, so that the partitioner saves the logits and that statistic for the
backward rather than the log-probabilities (float32 ones, twice the bytes, for bfloat16
logits), and a reader of a few log-probabilities (nll_loss's gather of the target's) computes
them itself.

`_weight_norm_interface_backward` is the gradient of w = g * v / |v| (the norm over every dim
of v but `dim`), which autograd records for weight_norm's forward before decompositions apply.

`nll_loss_backward` (and its 2-d form) is the gradient of nll_loss by its input `x`
(log-probabilities, classes along dim 1, or along the only dim): -grad * weight[target]
(divided by total_weight for the mean) at each target class, 0 at the other classes and where
the target is ignore_index. It is written element by element from the target, reading `x` only
for its shape: torch's decomposition scatters into zeros of x's size, and the op taken whole
would keep x (the forward's log-probabilities) saved for the backward. So the backward
recomputes the log-softmax from the logits and two per-row statistics, and makes with its
backward one row kernel: cross-entropy's gradient softmax(logits) - onehot(target), scaled,
with no tensor of the logits' size in between.
"""
from __future__ import annotations

import torch

from kiln.frontend.torch import register_decomposition

from kiln_mappings_aten.common import aten

_MEAN = 1   # ATen's Reduction::Mean (0: none, 2: sum)


@register_decomposition(aten.nll_loss_backward.default, aten.nll_loss2d_backward.default)
def nll_loss_backward(grad, x, target, weight, reduction, ignore_index, total_weight):
    """-grad * weight[target] (/ total_weight for the mean) at each target class, else 0."""
    dim = min(x.dim() - 1, 1)
    target = target.unsqueeze(dim)
    scale = -grad if reduction != _MEAN else -grad / total_weight
    if scale.dim():
        scale = scale.unsqueeze(dim)
    classes = torch.arange(x.shape[dim], device=x.device).reshape((-1,) + (1,) * (x.dim() - dim - 1))
    if weight is not None:
        scale = scale * weight.reshape(classes.shape)
    hot = (classes == target) & (target != ignore_index)
    return torch.where(hot, scale, 0).to(x.dtype)


@register_decomposition(aten._log_softmax.default)
def log_softmax(x, dim, half_to_float):
    """x - logsumexp(x) along `dim`, in float32 for 16-bit x (returned in float32 with
    `half_to_float`, else in x's dtype)."""
    wide = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    out = wide - torch.logsumexp(wide, dim, keepdim=True)
    return out if half_to_float else out.to(x.dtype)


@register_decomposition(aten._weight_norm_interface_backward.default)
def weight_norm_backward(grad_w, v, g, norms, dim):
    """(grad of v, grad of g) of w = g * v / norms: with s = sum(grad_w * v) over the normed
    dims, grad_g = s / norms and grad_v = g / norms * (grad_w - v * s / norms**2)."""
    dims = [d for d in range(v.dim()) if d != dim % v.dim()] if dim != -1 else list(range(v.dim()))
    wide = torch.promote_types(v.dtype, torch.float32)
    grad_w, v, g, norms = grad_w.to(wide), v.to(wide), g.to(wide), norms.to(wide)
    s = (grad_w * v).sum(dims, keepdim=True)
    grad_v = g / norms * (grad_w - v * (s / (norms * norms)))
    return grad_v.to(v.dtype), (s / norms).reshape(g.shape).to(g.dtype)
