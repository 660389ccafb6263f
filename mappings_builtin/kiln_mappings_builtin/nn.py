"""torch.nn.functional and linear algebra: linear, matmul, convolution, pooling, normalization,
dropout, embedding and embedding_bag, one_hot, padding, interpolation, grid_sample, affine_grid
and scaled_dot_product_attention."""
import math

import torch
import torch.nn.functional as F

from kiln import ops
from kiln.frontend.torch import register_function, register_method

from kiln_mappings_builtin.common import direct, is_tensor, no_out
from kiln_mappings_builtin.products import plus_scaled
from kiln_mappings_builtin.reduce import vector_norm


def _torch_and_functional(name: str) -> list:
    """torch.nn.functional.NAME and torch.NAME, once each (some are one object)."""
    return list(dict.fromkeys(f for f in (getattr(F, name, None), getattr(torch, name, None))
                              if callable(f)))


direct("matmul", [torch.matmul, torch.mm, torch.bmm], ["matmul", "mm", "bmm"])
for _name in ("linear", "conv1d", "conv2d", "conv3d", "avg_pool1d", "avg_pool2d", "avg_pool3d",
              "adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d", "interpolate",
              "conv_transpose1d", "conv_transpose2d", "conv_transpose3d"):
    direct(_name, _torch_and_functional(_name))


@register_function(F.one_hot, check=lambda tensor, num_classes=-1: num_classes != -1)
def one_hot(tensor, num_classes=-1):
    """With `num_classes` given (without it the size comes from the data: not mapped)."""
    return ops.one_hot(tensor, num_classes)


def _area(input, size=None, scale_factor=None, mode="nearest", *args, **kwargs) -> bool:
    return mode == "area"


@register_function(F.interpolate, priority=1, check=_area)
def interpolate_area(input, size=None, scale_factor=None, mode="nearest", align_corners=None,
                     recompute_scale_factor=None, antialias=False):
    """Area interpolation is adaptive average pooling to the output size."""
    spatial = input.shape[2:]
    if size is None:
        scales = scale_factor if isinstance(scale_factor, (tuple, list)) else [scale_factor] * len(spatial)
        size = [math.floor(n * s) for n, s in zip(spatial, scales)]
    pool = getattr(ops, f"adaptive_avg_pool{len(spatial)}d")
    return pool(input, size if isinstance(size, int) else tuple(size))


@register_function(F.upsample)
def upsample(input, size=None, scale_factor=None, mode="nearest", align_corners=None):
    """The deprecated alias of interpolate."""
    if mode == "area":
        return interpolate_area(input, size, scale_factor)
    return ops.interpolate(input, size, scale_factor, mode, align_corners)


@register_function(F.upsample_nearest)
def upsample_nearest(input, size=None, scale_factor=None):
    return ops.interpolate(input, size, scale_factor, "nearest")


@register_function(F.upsample_bilinear)
def upsample_bilinear(input, size=None, scale_factor=None):
    return ops.interpolate(input, size, scale_factor, "bilinear", True)


def _max_pool_rules(nd: int):
    """Rules for F.max_pool{nd}d (values, or values and positions with return_indices) and
    F.max_pool{nd}d_with_indices (always both, whatever its return_indices says)."""
    def pool(input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False,
             return_indices=False):
        op = f"max_pool{nd}d_with_indices" if return_indices else f"max_pool{nd}d"
        return getattr(ops, op)(input, kernel_size, stride or kernel_size, padding, dilation, ceil_mode)

    def pool_with_indices(input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False,
                          return_indices=False):
        return pool(input, kernel_size, stride, padding, dilation, ceil_mode, True)

    pool.__name__ = pool.__qualname__ = f"max_pool{nd}d"
    pool_with_indices.__name__ = pool_with_indices.__qualname__ = f"max_pool{nd}d_with_indices"
    return (register_function(*_torch_and_functional(f"max_pool{nd}d"))(pool),
            register_function(getattr(F, f"max_pool{nd}d_with_indices"))(pool_with_indices))


(max_pool1d, max_pool1d_with_indices), (max_pool2d, max_pool2d_with_indices), \
    (max_pool3d, max_pool3d_with_indices) = (_max_pool_rules(nd) for nd in (1, 2, 3))


def _no_adaptive_indices(input, output_size, return_indices=False) -> bool:
    return not return_indices


@register_function(F.adaptive_max_pool1d, check=_no_adaptive_indices)
def adaptive_max_pool1d(input, output_size, return_indices=False):
    return ops.adaptive_max_pool1d(input, output_size)


@register_function(F.adaptive_max_pool2d, check=_no_adaptive_indices)
def adaptive_max_pool2d(input, output_size, return_indices=False):
    return ops.adaptive_max_pool2d(input, output_size)


@register_function(F.adaptive_max_pool3d, check=_no_adaptive_indices)
def adaptive_max_pool3d(input, output_size, return_indices=False):
    return ops.adaptive_max_pool3d(input, output_size)


@register_function(torch.addmm, check=no_out)
@register_method("addmm")
def addmm(input, mat1, mat2, *, beta=1, alpha=1, out=None):
    """beta * input + alpha * (mat1 @ mat2), `input` broadcast to the product; beta 0 ignores
    input, its NaN and inf too, as PyTorch does."""
    product = ops.matmul(mat1, mat2)
    return plus_scaled(product if alpha == 1 else ops.mul(product, alpha), input, beta)


@register_function(torch.baddbmm, check=no_out)
@register_method("baddbmm")
def baddbmm(input, batch1, batch2, *, beta=1, alpha=1, out=None):
    """`addmm` of batches, under PyTorch's argument names (BLOOM passes them by name, its alibi
    `input` of (batch * heads, 1, n) broadcast to the product)."""
    return addmm(input, batch1, batch2, beta=beta, alpha=alpha)



@register_function(F.softmax)
def softmax(input, dim=None, _stacklevel=3, dtype=None):
    return ops.softmax(input, dim, dtype)


@register_function(F.log_softmax)
def log_softmax(input, dim=None, _stacklevel=3, dtype=None):
    return ops.log_softmax(input, dim, dtype)


def _inference(input, running_mean, running_var, weight=None, bias=None, training=False,
               momentum=0.1, eps=1e-5) -> bool:
    return not training and running_mean is not None


@register_function(F.batch_norm, check=_inference)
def batch_norm(input, running_mean, running_var, weight=None, bias=None, training=False,
               momentum=0.1, eps=1e-5):
    return ops.batch_norm(input, running_mean, running_var, weight, bias, eps)


@register_function(F.layer_norm, torch.layer_norm)
def layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5, cudnn_enable=True):
    return ops.layer_norm(input, tuple(normalized_shape), weight, bias, eps)


@register_function(F.group_norm, torch.group_norm)
def group_norm(input, num_groups, weight=None, bias=None, eps=1e-5, cudnn_enable=True):
    return ops.group_norm(input, num_groups, weight, bias, eps)


@register_function(F.rms_norm, torch.rms_norm)
def rms_norm(input, normalized_shape, weight=None, eps=None):
    return ops.rms_norm(input, tuple(normalized_shape), weight, eps)


@register_function(F.normalize)
def normalize(input, p=2.0, dim=1, eps=1e-12, out=None):
    return ops.div(input, ops.clamp(vector_norm(input, p, dim, True), min=eps))


@register_function(F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout,
                   torch.dropout, check=lambda input, p=0.5, training=True, inplace=False:
                   not training or p == 0)
def dropout(input, p=0.5, training=True, inplace=False):
    return input


@register_function(F.embedding, check=lambda input, weight, padding_idx=None, max_norm=None, *a,
                   **k: max_norm is None)
def embedding(input, weight, padding_idx=None, max_norm=None, norm_type=2.0,
              scale_grad_by_freq=False, sparse=False):
    return ops.embedding(input, weight)


def _no_max_norm(input, weight, offsets=None, max_norm=None, *args, **kwargs) -> bool:
    return max_norm is None


@register_function(F.embedding_bag, check=_no_max_norm)
def embedding_bag(input, weight, offsets=None, max_norm=None, norm_type=2, scale_grad_by_freq=False,
                  mode="mean", sparse=False, per_sample_weights=None, include_last_offset=False,
                  padding_idx=None):
    return ops.embedding_bag(input, weight, offsets, mode, per_sample_weights, include_last_offset, padding_idx)


def _sampled(input, grid, mode="bilinear", *args, **kwargs) -> bool:
    return mode != "bicubic" and input.ndim == 4


@register_function(F.grid_sample, check=_sampled)
def grid_sample(input, grid, mode="bilinear", padding_mode="zeros", align_corners=None):
    return ops.grid_sample(input, grid, mode, padding_mode, bool(align_corners))


@register_function(F.affine_grid, check=lambda theta, size, align_corners=None: len(size) == 4)
def affine_grid(theta, size, align_corners=None):
    return ops.affine_grid(theta, list(size), bool(align_corners))


def _pad_amounts(pad) -> list | None:
    """The pad amounts as ints, a one-element tensor read as its value where it is known (a
    constant of the graph, or an input whose value the trace is made for); None where one is
    known only when the graph runs."""
    amounts = []
    for p in pad:
        if is_tensor(p):
            if p.is_symbolic or p.numel() != 1 or not p.dtype.is_integer:
                return None
            p = int(p.torch().item())
        amounts.append(p)
    return amounts


def _pad_mode(input, pad, mode="constant", value=None) -> bool:
    amounts = _pad_amounts(pad)
    return amounts is not None and (mode in ("constant", "reflect", "replicate")
                                    or mode == "circular" and min(amounts) >= 0)


@register_function(F.pad, torch._C._nn.pad, check=_pad_mode)
def pad(input, pad, mode="constant", value=None):
    """F.pad; amounts may be one-element tensors of known value (`_pad_amounts`)."""
    if mode == "circular":
        return _circular_pad(input, _pad_amounts(pad))
    return ops.pad(input, _pad_amounts(pad), mode, 0 if value is None else value)


def _circular_pad(input, pad):
    """Wrap-around padding: the last elements before, the first ones after, last dim first."""
    for k in range(len(pad) // 2):
        d, before, after = input.ndim - 1 - k, pad[2 * k], pad[2 * k + 1]
        n = input.shape[d]
        parts = ([ops.slice(input, d, n - before, n)] if before else []) + [input] + \
            ([ops.slice(input, d, 0, after)] if after else [])
        input = ops.cat(parts, d) if len(parts) > 1 else input
    return input


def _attention_supported(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                         scale=None, enable_gqa=False) -> bool:
    """What the attention operator computes: no dropout, not both a mask and is_causal,
    key/value heads equal to the query heads, one head, or (with enable_gqa) a divisor of
    them, keys and values of one batch shape, and a mask that does not widen the scores."""
    if dropout_p or (is_causal and attn_mask is not None) or min(query.ndim, key.ndim) < 2:
        return False
    if tuple(key.shape[:-2]) != tuple(value.shape[:-2]) or key.shape[-2] != value.shape[-2]:
        return False
    heads_q, heads_kv = (query.shape[-3] if query.ndim >= 3 else 1), (key.shape[-3] if key.ndim >= 3 else 1)
    if heads_kv not in (1, heads_q) and not (enable_gqa and heads_q % heads_kv == 0):
        return False
    try:
        scores = torch.broadcast_shapes(tuple(query.shape[:-3]), tuple(key.shape[:-3]))
        scores += (max(heads_q, heads_kv), query.shape[-2], key.shape[-2])
        return attn_mask is None or torch.broadcast_shapes(tuple(attn_mask.shape), scores) == scores
    except RuntimeError:
        return False


def _same_rank(*tensors):
    """The tensors with leading dims of size 1 added up to the largest rank."""
    rank = max(t.ndim for t in tensors)
    return [ops.reshape(t, [1] * (rank - t.ndim) + list(t.shape)) if t.ndim < rank else t for t in tensors]


@register_function(F.scaled_dot_product_attention, check=_attention_supported)
def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, scale=None, enable_gqa=False):
    """One attention operator: a bool mask keeps where True, a float mask is added, is_causal
    keeps the lower triangle; a query whose keys are all masked gets zeros, as in PyTorch."""
    query, key, value = _same_rank(query, key, value)
    return ops.attention(query, key, value, mask=attn_mask, scale=scale, is_causal=is_causal)
