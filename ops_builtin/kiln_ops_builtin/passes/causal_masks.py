"""Attention whose mask is a constant that says no more than the causal flag drops the mask.

Models build their attention masks inside the graph from positions alone (transformers'
`create_causal_mask` from `arange`, comparisons and a packed-sequence check), so the mask is
known before the graph runs: a constant, or, past `kiln.graph.GENERATED_BYTES_HELD` (GPT-2's
[8, 1, 512, 512] mask), a generated value the graph computes where it is used
(`kiln.graph.known_value` computes it now). Such a mask may keep key j for query i exactly
where j <= i, or keep every key. Read through a mask, the fused kernels run every tile and test every score; with the
causal flag they skip the tiles above the diagonal. The rewrite applies to `attention`,
`attention_forward` and `attention_backward` (which take `is_causal` with top-left alignment, as
PyTorch does).

A mask whose sizes are symbolic is known at the traced sizes only, and computing it there reads
the sizes, so the plan then serves those sizes alone (`kiln.frontend.torch.plan_reuse`). The
training operators pay that (the causal flag saves most of the attention backward, and training
seldom changes length); inference `attention`, whose graph meets a new length with every prompt,
keeps such a mask.
"""
from __future__ import annotations

import torch

from kiln.graph import known_value
from kiln.ir import SymSize
from kiln.passes.edit import arguments_of, rebuild, remake
from kiln.passes.graph_pass import GraphPass
from kiln.tensor import Tensor

ATTENTION = frozenset({"attention", "attention_forward", "attention_backward"})


def implied_causality(mask: torch.Tensor, queries: int, keys: int) -> bool | None:
    """True where the bool values `mask`, broadcast to [..., queries, keys], keep exactly the
    causal keys; False where they keep every key; None otherwise (the mask says more)."""
    m = mask.expand(*mask.shape[:-2], queries, keys)
    if bool(m.all()):
        return False
    causal = torch.ones(queries, keys, dtype=torch.bool, device=m.device).tril()
    return True if bool((m == causal).all()) else None


def _symbolic(*tensors: Tensor) -> bool:
    """Whether a size of `tensors` is symbolic (known at run time)."""
    return any(isinstance(d, SymSize) for t in tensors for d in t.shape)


def _rewrite(node, inputs):
    if node.definition.name not in ATTENTION:
        return None
    args = arguments_of(node)
    mask, q, k = args.get("mask"), args["q"], args["k"]
    if not isinstance(mask, Tensor) or (node.definition.name == "attention" and _symbolic(mask, q, k)):
        return None
    values = known_value(mask)
    if values is None:
        return None
    causal = implied_causality(values, q.shape[-2], k.shape[-2])
    if causal is None:
        return None
    return remake(node, inputs, mask=None, is_causal=args["is_causal"] or causal)


class CausalMasks(GraphPass):
    """Drop each attention mask known before the graph runs that keeps every key, or exactly
    the causal keys (then setting `is_causal`)."""

    name = "causal_masks"
    opt_level = 1
    stage = "precision"     # after constant folding has made the masks constants

    def transform(self, graph, ctx):
        return rebuild(graph, _rewrite)
