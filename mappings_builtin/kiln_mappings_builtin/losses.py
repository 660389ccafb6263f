"""Loss functions of torch.nn.functional, composed from element-wise operators and reductions:
mse, l1, smooth_l1, huber, kl_div, binary_cross_entropy (with and without logits), nll_loss and
cross_entropy (class indices or probabilities, weights, ignore_index, label smoothing), with
reduction 'mean', 'sum' or 'none'."""
import math

import torch.nn.functional as F

from kiln import ops
from kiln.frontend.torch import register_function


def _reduced(loss, reduction: str):
    if reduction == "none":
        return loss
    if reduction == "sum":
        return ops.sum(loss)
    if reduction == "mean":
        return ops.mean(loss)
    raise ValueError(f"loss: reduction must be 'none', 'mean' or 'sum', got {reduction!r}")


def _legacy(size_average, reduce, reduction: str) -> str:
    """The reduction that the deprecated size_average/reduce flags ask for."""
    if size_average is None and reduce is None:
        return reduction
    if reduce is False:
        return "none"
    return "sum" if size_average is False else "mean"


@register_function(F.mse_loss)
def mse_loss(input, target, size_average=None, reduce=None, reduction="mean", weight=None):
    d = ops.sub(input, target)
    return _reduced(ops.mul(d, d), _legacy(size_average, reduce, reduction))


@register_function(F.l1_loss)
def l1_loss(input, target, size_average=None, reduce=None, reduction="mean"):
    return _reduced(ops.abs(ops.sub(input, target)), _legacy(size_average, reduce, reduction))


def _huberish(input, target, beta: float, scale_quadratic: bool):
    d = ops.abs(ops.sub(input, target))
    quadratic = ops.mul(ops.mul(d, d), 0.5 / beta if scale_quadratic else 0.5)
    linear = ops.sub(d, 0.5 * beta) if scale_quadratic else ops.mul(ops.sub(d, 0.5 * beta), beta)
    return ops.where(ops.lt(d, beta), quadratic, linear)


@register_function(F.smooth_l1_loss)
def smooth_l1_loss(input, target, size_average=None, reduce=None, reduction="mean", beta=1.0):
    reduction = _legacy(size_average, reduce, reduction)
    if beta == 0:
        return l1_loss(input, target, reduction=reduction)
    return _reduced(_huberish(input, target, beta, True), reduction)


@register_function(F.huber_loss)
def huber_loss(input, target, reduction="mean", delta=1.0, weight=None):
    return _reduced(_huberish(input, target, delta, False), reduction)


@register_function(F.kl_div)
def kl_div(input, target, size_average=None, reduce=None, reduction="mean", log_target=False):
    """target * (log target - input) pointwise; 'batchmean' divides the sum by the batch size."""
    if log_target:
        loss = ops.mul(ops.exp(target), ops.sub(target, input))
    else:
        loss = ops.where(ops.gt(target, 0), ops.mul(target, ops.sub(ops.log(target), input)), 0.0)
    reduction = _legacy(size_average, reduce, reduction)
    if reduction == "batchmean":
        return ops.div(ops.sum(loss), input.shape[0] if input.ndim else 1)
    return _reduced(loss, reduction)


@register_function(F.binary_cross_entropy)
def binary_cross_entropy(input, target, weight=None, size_average=None, reduce=None, reduction="mean"):
    """-(t log p + (1 - t) log(1 - p)), each log clamped at -100 as PyTorch does."""
    log_p = ops.clamp(ops.log(input), min=-100.0)
    log_q = ops.clamp(ops.log(ops.sub(1.0, input)), min=-100.0)
    loss = ops.neg(ops.add(ops.mul(target, log_p), ops.mul(ops.sub(1.0, target), log_q)))
    loss = loss if weight is None else ops.mul(loss, weight)
    return _reduced(loss, _legacy(size_average, reduce, reduction))


@register_function(F.binary_cross_entropy_with_logits)
def binary_cross_entropy_with_logits(input, target, weight=None, size_average=None, reduce=None,
                                     reduction="mean", pos_weight=None):
    """(1 - t) x + (1 + (w_pos - 1) t) * softplus(-x), the stable form PyTorch uses."""
    log_sigmoid_neg = ops.neg(ops.logsigmoid(input))  # softplus(-x) = -logsigmoid(x)
    if pos_weight is not None:
        log_sigmoid_neg = ops.mul(log_sigmoid_neg, ops.add(ops.mul(ops.sub(pos_weight, 1.0), target), 1.0))
    loss = ops.add(ops.mul(ops.sub(1.0, target), input), log_sigmoid_neg)
    loss = loss if weight is None else ops.mul(loss, weight)
    return _reduced(loss, _legacy(size_average, reduce, reduction))


def _class_dim_last(t):
    """(N, C, d1, ...) -> (N, d1, ..., C); (C,) and (N, C) unchanged."""
    return t if t.ndim <= 2 else ops.permute(t, [0] + list(range(2, t.ndim)) + [1])


def _nll(log_probs, target, weight, ignore_index: int, reduction: str):
    """Negative log-likelihood of class indices `target` under `log_probs` (class dim last)."""
    valid = ops.ne(target, ignore_index)
    safe = ops.where(valid, target, 0)
    picked = ops.squeeze(ops.take_along_dim(log_probs, ops.unsqueeze(safe, -1), -1), -1)
    w = ops.where(valid, 1.0, 0.0) if weight is None else \
        ops.where(valid, ops.index_select(weight, 0, ops.reshape(safe, (-1,))), 0.0)
    if weight is not None:
        w = ops.reshape(w, safe.shape)
    w = ops.cast(w, log_probs.dtype)
    loss = ops.neg(ops.mul(picked, w))
    if reduction == "mean":
        return ops.div(ops.sum(loss), ops.sum(w))
    return _reduced(loss, reduction)


@register_function(F.nll_loss)
def nll_loss(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
             reduction="mean"):
    return _nll(_class_dim_last(input), target, weight, ignore_index, _legacy(size_average, reduce, reduction))


@register_function(F.cross_entropy)
def cross_entropy(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                  reduction="mean", label_smoothing=0.0):
    """log_softmax over the class dim (1, or 0 unbatched), then nll for class indices, or
    -sum(target * log_probs) for class probabilities."""
    reduction = _legacy(size_average, reduce, reduction)
    log_probs = _class_dim_last(ops.log_softmax(input, 1 if input.ndim > 1 else 0))
    classes = log_probs.shape[-1]
    if target.dtype.is_float:
        target = _class_dim_last(target)
        if label_smoothing:
            target = ops.add(ops.mul(target, 1 - label_smoothing), label_smoothing / classes)
        weighted = log_probs if weight is None else ops.mul(log_probs, weight)
        loss = ops.neg(ops.sum(ops.mul(weighted, target), -1))
        if reduction == "mean":
            return ops.div(ops.sum(loss), loss.numel() if loss.ndim else 1)
        return _reduced(loss, reduction)
    loss = _nll(log_probs, target, weight, ignore_index, reduction)
    if not label_smoothing:
        return loss
    valid = ops.cast(ops.ne(target, ignore_index), log_probs.dtype)
    weighted = log_probs if weight is None else ops.mul(log_probs, weight)
    smooth = ops.mul(ops.neg(ops.sum(weighted, -1)), valid)
    if reduction == "mean":
        w = valid if weight is None else ops.mul(valid, ops.reshape(
            ops.index_select(weight, 0, ops.reshape(ops.where(ops.ne(target, ignore_index), target, 0), (-1,))),
            target.shape))
        smooth = ops.div(ops.sum(smooth), ops.sum(w))
    else:
        smooth = _reduced(smooth, reduction)
    return ops.add(ops.mul(loss, 1 - label_smoothing), ops.mul(smooth, label_smoothing / classes))




@register_function(F.soft_margin_loss)
def soft_margin_loss(input, target, size_average=None, reduce=None, reduction="mean"):
    return _reduced(ops.log1p(ops.exp(ops.neg(ops.mul(target, input)))), _legacy(size_average, reduce, reduction))


@register_function(F.margin_ranking_loss)
def margin_ranking_loss(input1, input2, target, margin=0.0, size_average=None, reduce=None, reduction="mean"):
    loss = ops.clamp(ops.add(ops.mul(ops.neg(target), ops.sub(input1, input2)), margin), min=0.0)
    return _reduced(loss, _legacy(size_average, reduce, reduction))


@register_function(F.hinge_embedding_loss)
def hinge_embedding_loss(input, target, margin=1.0, size_average=None, reduce=None, reduction="mean"):
    hinge = ops.clamp(ops.sub(margin, input), min=0.0)
    loss = ops.add(ops.where(ops.eq(target, 1), input, 0.0), ops.where(ops.eq(target, -1), hinge, 0.0))
    return _reduced(loss, _legacy(size_average, reduce, reduction))


@register_function(F.cosine_embedding_loss)
def cosine_embedding_loss(input1, input2, target, margin=0.0, size_average=None, reduce=None, reduction="mean"):
    eps = 1e-12
    dot = ops.sum(ops.mul(input1, input2), -1)
    norms = ops.sqrt(ops.mul(ops.add(ops.sum(ops.mul(input1, input1), -1), eps),
                             ops.add(ops.sum(ops.mul(input2, input2), -1), eps)))
    cos = ops.div(dot, norms)
    loss = ops.add(ops.where(ops.eq(target, 1), ops.sub(1.0, cos), 0.0),
                   ops.where(ops.eq(target, -1), ops.clamp(ops.sub(cos, margin), min=0.0), 0.0))
    return _reduced(loss, _legacy(size_average, reduce, reduction))


@register_function(F.poisson_nll_loss)
def poisson_nll_loss(input, target, log_input=True, full=False, size_average=None, eps=1e-8, reduce=None,
                     reduction="mean"):
    if log_input:
        loss = ops.sub(ops.exp(input), ops.mul(target, input))
    else:
        loss = ops.sub(input, ops.mul(target, ops.log(ops.add(input, eps))))
    if full:
        stirling = ops.add(ops.sub(ops.mul(target, ops.log(target)), target),
                           ops.mul(ops.log(ops.mul(target, 2 * math.pi)), 0.5))
        loss = ops.add(loss, ops.where(ops.gt(target, 1), stirling, 0.0))
    return _reduced(loss, _legacy(size_average, reduce, reduction))


@register_function(F.multilabel_soft_margin_loss)
def multilabel_soft_margin_loss(input, target, weight=None, size_average=None, reduce=None, reduction="mean"):
    loss = ops.neg(ops.add(ops.mul(target, ops.logsigmoid(input)),
                           ops.mul(ops.sub(1.0, target), ops.logsigmoid(ops.neg(input)))))
    loss = loss if weight is None else ops.mul(loss, weight)
    return _reduced(ops.mean(loss, -1), _legacy(size_average, reduce, reduction))


def _pairwise(x1, x2, p, eps):
    d = ops.add(ops.sub(x1, x2), eps)
    return ops.pow(ops.sum(ops.pow(ops.abs(d), p), -1), 1 / p)


@register_function(F.triplet_margin_loss)
def triplet_margin_loss(anchor, positive, negative, margin=1.0, p=2, eps=1e-6, swap=False, size_average=None,
                        reduce=None, reduction="mean"):
    d_pos, d_neg = _pairwise(anchor, positive, p, eps), _pairwise(anchor, negative, p, eps)
    if swap:
        d_neg = ops.minimum(d_neg, _pairwise(positive, negative, p, eps))
    loss = ops.clamp(ops.add(ops.sub(d_pos, d_neg), margin), min=0.0)
    return _reduced(loss, _legacy(size_average, reduce, reduction))
