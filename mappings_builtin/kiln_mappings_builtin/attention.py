"""nn.MultiheadAttention's functional core, F.multi_head_attention_forward: the projections as
linears around the fused `attention` operator, or, where the caller wants the attention
weights too, batched matmuls around a softmax (inference: no dropout, no bias_k/bias_v, no
zero attention, no static keys); and nn.TransformerEncoderLayer's inference fast path,
`torch._transformer_encoder_layer_fwd`."""
import math

import torch
import torch.nn.functional as F

from kiln import dtypes, ops
from kiln.frontend.torch import register_function


def _supported(query, key, value, embed_dim_to_check, num_heads, in_proj_weight, in_proj_bias,
               bias_k, bias_v, add_zero_attn, dropout_p, out_proj_weight, out_proj_bias,
               training=True, key_padding_mask=None, need_weights=True, attn_mask=None,
               use_separate_proj_weight=False, q_proj_weight=None, k_proj_weight=None,
               v_proj_weight=None, static_k=None, static_v=None, average_attn_weights=True,
               is_causal=False) -> bool:
    return (bias_k is None and bias_v is None and not add_zero_attn and static_k is None
            and static_v is None and (not training or dropout_p == 0)
            and not (is_causal and attn_mask is None))


def _additive(mask, dtype):
    """A bool mask (True: not allowed) as 0 / -inf; a float mask as it is."""
    if mask.dtype == dtypes.boolean:
        return ops.where(mask, float("-inf"), ops.full((), 0.0, dtype=dtype, device=mask.device))
    return mask


def _heads(x, length: int, batch: int, heads: int, head_dim: int):
    """(length, batch, heads * head_dim) -> (batch * heads, length, head_dim)."""
    return ops.transpose(ops.reshape(x, (length, batch * heads, head_dim)), 0, 1)


def _fused(q, k, v, mask, length: int, source: int, batch: int, heads: int, head_dim: int):
    """The attention of heads (batch * heads, length, head_dim) through the `attention`
    operator, as (length, batch, heads * head_dim)."""
    split = lambda t, n: ops.reshape(t, (batch, heads, n, head_dim))
    if mask is not None:
        mask = ops.reshape(ops.expand(mask, (batch * heads, length, source)), (batch, heads, length, source))
    out = ops.attention(split(q, length), split(k, source), split(v, source), mask)
    return ops.reshape(ops.permute(out, (2, 0, 1, 3)), (length, batch, heads * head_dim))


@register_function(F.multi_head_attention_forward, check=_supported)
def multi_head_attention_forward(query, key, value, embed_dim_to_check, num_heads, in_proj_weight,
                                 in_proj_bias, bias_k, bias_v, add_zero_attn, dropout_p,
                                 out_proj_weight, out_proj_bias, training=True, key_padding_mask=None,
                                 need_weights=True, attn_mask=None, use_separate_proj_weight=False,
                                 q_proj_weight=None, k_proj_weight=None, v_proj_weight=None,
                                 static_k=None, static_v=None, average_attn_weights=True,
                                 is_causal=False):
    """Sequence-first (L, N, E) or unbatched (L, E) inputs, as PyTorch's math path computes them."""
    unbatched = query.ndim == 2
    if unbatched:
        query, key, value = (ops.unsqueeze(t, 1) for t in (query, key, value))
        key_padding_mask = None if key_padding_mask is None else ops.unsqueeze(key_padding_mask, 0)
    length, batch, embed = query.shape
    source = key.shape[0]
    head_dim = embed // num_heads
    if use_separate_proj_weight:
        weights = (q_proj_weight, k_proj_weight, v_proj_weight)
    else:
        weights = tuple(ops.slice(in_proj_weight, 0, k * embed, (k + 1) * embed) for k in range(3))
    biases = (None,) * 3 if in_proj_bias is None else \
        tuple(ops.slice(in_proj_bias, 0, k * embed, (k + 1) * embed) for k in range(3))
    if query is key is value and not use_separate_proj_weight:
        # self-attention: one projection of 3 * embed, read by the attention through slices
        qkv = ops.linear(query, in_proj_weight, in_proj_bias)
        q, k, v = (ops.slice(qkv, 2, n * embed, (n + 1) * embed) for n in range(3))
    else:
        q, k, v = (ops.linear(t, w, b) for t, w, b in zip((query, key, value), weights, biases))
    q = _heads(q, length, batch, num_heads, head_dim)
    k = _heads(k, source, batch, num_heads, head_dim)
    v = _heads(v, source, batch, num_heads, head_dim)

    mask = None if attn_mask is None else _additive(attn_mask, query.dtype)
    if mask is not None and mask.ndim == 2:
        mask = ops.unsqueeze(mask, 0)
    if key_padding_mask is not None:
        padding = ops.reshape(_additive(key_padding_mask, query.dtype), (batch, 1, 1, source))
        padding = ops.reshape(ops.expand(padding, (batch, num_heads, 1, source)),
                              (batch * num_heads, 1, source))
        mask = padding if mask is None else ops.add(mask, padding)
    if not need_weights:
        out = _fused(q, k, v, mask, length, source, batch, num_heads, head_dim)
        out = ops.linear(out, out_proj_weight, out_proj_bias)
        return (ops.squeeze(out, 1) if unbatched else out), None

    scores = ops.matmul(ops.mul(q, 1 / math.sqrt(head_dim)), ops.transpose(k, 1, 2))
    if mask is not None:
        scores = ops.add(scores, mask)
    probs = ops.softmax(scores, -1)
    out = ops.transpose(ops.matmul(probs, v), 0, 1)  # (L, N * H, head_dim)
    out = ops.linear(ops.reshape(out, (length * batch, embed)), out_proj_weight, out_proj_bias)
    out = ops.reshape(out, (length, batch, embed))
    weights_out = None
    if need_weights:
        weights_out = ops.reshape(probs, (batch, num_heads, length, source))
        if average_attn_weights:
            weights_out = ops.mean(weights_out, 1)
        if unbatched:
            weights_out = ops.squeeze(weights_out, 0)
    return (ops.squeeze(out, 1) if unbatched else out), weights_out


def _encoder_mask(mask, mask_type, batch: int, heads: int, length: int, dtype):
    """The merged mask of the encoder layer's fast path (True or -inf: not attended) as an
    additive mask broadcasting to the scores (batch, heads, length, length): type 0 is an
    attention mask (length, length), 1 a key padding mask (batch, length), 2 both merged
    (batch, heads, length, length)."""
    if mask is None:
        return None
    mask = _additive(mask, dtype)
    return ops.reshape(mask, (batch, 1, 1, length)) if mask_type == 1 else mask


@register_function(torch._transformer_encoder_layer_fwd)
def transformer_encoder_layer_fwd(src, embed_dim, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias,
                                  use_gelu, norm_first, eps, norm_weight_1, norm_bias_1, norm_weight_2,
                                  norm_bias_2, ffn_weight_1, ffn_bias_1, ffn_weight_2, ffn_bias_2,
                                  mask=None, mask_type=None):
    """nn.TransformerEncoderLayer's inference fast path (batch first, (N, L, E)): self-attention
    on one projection, the feed-forward block with GELU or ReLU, layer norms before or after."""
    batch, length, _ = src.shape
    head_dim = embed_dim // num_heads
    heads = lambda t: ops.permute(ops.reshape(t, (batch, length, num_heads, head_dim)), (0, 2, 1, 3))
    norm = lambda x, w, b: ops.layer_norm(x, [embed_dim], w, b, eps)

    def attend(x):
        q, k, v = (heads(t) for t in ops.split(ops.linear(x, qkv_weight, qkv_bias), embed_dim, -1))
        out = ops.attention(q, k, v, _encoder_mask(mask, mask_type, batch, num_heads, length, src.dtype))
        return ops.linear(ops.reshape(ops.permute(out, (0, 2, 1, 3)), (batch, length, embed_dim)),
                          proj_weight, proj_bias)

    def feed_forward(x):
        hidden = ops.linear(x, ffn_weight_1, ffn_bias_1)
        return ops.linear(ops.gelu(hidden) if use_gelu else ops.relu(hidden), ffn_weight_2, ffn_bias_2)

    if norm_first:
        x = ops.add(src, attend(norm(src, norm_weight_1, norm_bias_1)))
        return ops.add(x, feed_forward(norm(x, norm_weight_2, norm_bias_2)))
    x = norm(ops.add(src, attend(src)), norm_weight_1, norm_bias_1)
    return norm(ops.add(x, feed_forward(x)), norm_weight_2, norm_bias_2)
