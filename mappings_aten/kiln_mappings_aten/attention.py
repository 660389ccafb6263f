"""Attention in training graphs: `scaled_dot_product_attention` as one forward op that saves each
query row's log-sum-exp and one backward op, onto Kiln's `attention_forward` and
`attention_backward`, so that the backward recomputes the probabilities instead of saving them.

Two torch operators carry the split through AOTAutograd: `kiln::attention_forward` (returning
the output and the float32 log-sum-exp) and `kiln::attention_backward`, its gradient. Kiln's
decomposition of `aten.scaled_dot_product_attention` uses them where they compute what was
asked (`fused_applies`: no dropout, no mask or a bool one, q/k/v of rank 4 in a 16-bit type
with a head dim of FUSED_HEAD_DIMS on CUDA: where Kiln has fused kernels for them);
grouped-query heads are repeated first, so that autograd sums their gradients. Elsewhere it is
PyTorch's math form, as before. Outside Kiln's traces (a partition handed to PyTorch) both
operators run their math in float32 with torch.
"""
from __future__ import annotations

import math

import torch

from kiln.frontend.torch import register_decomposition

from kiln_mappings_aten.common import aten, same_signature

FUSED_DTYPES = (torch.float16, torch.bfloat16)
FUSED_DEVICES = ("cuda",)
FUSED_HEAD_DIMS = (32, 64, 128)


def _scores(q, k, scale: float, is_causal: bool, mask):
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(mask.logical_not(), float("-inf"))
    if is_causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


@torch.library.custom_op("kiln::attention_forward", mutates_args=())
def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, is_causal: bool,
                      mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(softmax(q k^T * scale) v, the float32 log-sum-exp of each query's kept scores)."""
    s = _scores(q, k, scale, is_causal, mask)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)
    return (p @ v.float()).to(q.dtype), lse


@attention_forward.register_fake
def _(q, k, v, scale, is_causal, mask):
    return q.new_empty(q.shape[:-1] + v.shape[-1:]), q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("kiln::attention_backward", mutates_args=())
def attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                       lse: torch.Tensor, scale: float, is_causal: bool, mask: torch.Tensor | None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of `attention_forward`'s output."""
    p = torch.exp(_scores(q, k, scale, is_causal, mask) - lse.unsqueeze(-1)).nan_to_num(0.0)
    do = dout.float()
    ds = p * (do @ v.float().transpose(-1, -2) - (do * out.float()).sum(-1, keepdim=True))
    return ((ds @ k.float() * scale).to(q.dtype), (ds.transpose(-1, -2) @ q.float() * scale).to(k.dtype),
            (p.transpose(-1, -2) @ do).to(v.dtype))


@attention_backward.register_fake
def _(dout, q, k, v, out, lse, scale, is_causal, mask):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _save(ctx, inputs, output):
    q, k, v, ctx.scale, ctx.is_causal, mask = inputs
    ctx.save_for_backward(q, k, v, *output, mask)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, mask = ctx.saved_tensors
    return (*attention_backward(dout, q, k, v, out, lse, ctx.scale, ctx.is_causal, mask), None, None, None)


attention_forward.register_autograd(_backward, setup_context=_save)


def fused_applies(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False) -> bool:
    """Whether the fused pair computes this attention: no dropout, no mask or a bool one without
    is_causal, rank-4 q/k/v of one 16-bit dtype and head dim on a device where Kiln has fused
    kernels for the pair."""
    mask_ok = attn_mask is None or (attn_mask.dtype == torch.bool and not is_causal)
    return (mask_ok and dropout_p == 0.0 and query.dim() == key.dim() == value.dim() == 4
            and query.dtype in FUSED_DTYPES and query.dtype == key.dtype == value.dtype
            and query.device.type in FUSED_DEVICES and query.shape[-1] == key.shape[-1] == value.shape[-1]
            and query.shape[-1] in FUSED_HEAD_DIMS
            and query.shape[1] % key.shape[1] == 0 and key.shape[1] == value.shape[1])


@register_decomposition(aten.scaled_dot_product_attention.default)
def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False):
    if not fused_applies(query, key, value, attn_mask, dropout_p, is_causal):
        if attn_mask is not None and attn_mask.dtype == torch.bool:      # as the composite does
            attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype, device=attn_mask.device).masked_fill(
                attn_mask.logical_not(), float("-inf"))
        return aten._scaled_dot_product_attention_math.default(
            query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)[0]
    group = query.shape[1] // key.shape[1]
    if group > 1:
        key, value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    return attention_forward(query, key, value, scale, is_causal, attn_mask)[0]


same_signature("attention_forward", torch.ops.kiln.attention_forward.default)
same_signature("attention_backward", torch.ops.kiln.attention_backward.default)
