"""Attention whose mask is a constant that says no more than the causal flag drops the mask.

Models build their attention masks inside the graph from positions alone (transformers'
`create_causal_mask` from `arange`, comparisons and a packed-sequence check), so the mask folds
to a constant: a bool tensor that keeps key j for query i exactly where j <= i, or keeps every
key. Read through a mask, the fused kernels run every tile and test every score; with the
causal flag they skip the tiles above the diagonal. The rewrite applies to `attention_forward`
and `attention_backward` (which take `is_causal` with top-left alignment, as PyTorch does).
"""
from __future__ import annotations

import torch

from kiln.passes.edit import arguments_of, rebuild, remake
from kiln.passes.graph_pass import GraphPass
from kiln.tensor import Tensor

ATTENTION = frozenset({"attention_forward", "attention_backward"})


def implied_causality(mask: Tensor, queries: int, keys: int) -> bool | None:
    """True where constant `mask`, broadcast to [..., queries, keys], keeps exactly the causal
    keys; False where it keeps every key; None otherwise (the mask says more)."""
    m = mask.torch()
    m = m.expand(*m.shape[:-2], queries, keys)
    if bool(m.all()):
        return False
    causal = torch.ones(queries, keys, dtype=torch.bool, device=m.device).tril()
    return True if bool((m == causal).all()) else None


def _rewrite(node, inputs):
    if node.definition.name not in ATTENTION:
        return None
    args = arguments_of(node)
    mask = args.get("mask")
    if not isinstance(mask, Tensor) or mask.is_symbolic:
        return None
    q, k = args["q"], args["k"]
    causal = implied_causality(mask, q.shape[-2], k.shape[-2])
    if causal is None:
        return None
    return remake(node, inputs, mask=None, is_causal=args["is_causal"] or causal)


class CausalMasks(GraphPass):
    """Drop each constant attention mask that keeps every key, or exactly the causal keys (then
    setting `is_causal`)."""

    name = "causal_masks"
    opt_level = 1
    stage = "precision"     # after constant folding has made the masks constants

    def transform(self, graph, ctx):
        return rebuild(graph, _rewrite)
