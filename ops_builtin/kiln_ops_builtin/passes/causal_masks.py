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

A mask of symbolic sizes is computed at the traced sizes without reading them
(`kiln.graph.known_value_at`), and the decision is kept as a check
(`kiln.ir.size_reads.note_check`): a plan reused at other sizes (`kiln.frontend.torch.plan_reuse`)
computes the mask there and serves them only where it says the same.
"""
from __future__ import annotations

import torch

from kiln.graph import known_value_at
from kiln.ir import SymSize
from kiln.ir.size import variables
from kiln.ir.size_reads import note_check
from kiln.passes.edit import arguments_of, rebuild, remake
from kiln.passes.graph_pass import GraphPass
from kiln.runtime.plan_binding import bound
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


def _form(size) -> object:
    """What identifies `size` without reading its value (a dict key a SymSize cannot be)."""
    return size.polynomial if isinstance(size, SymSize) else size


def _decide(mask: Tensor, lq, lk):
    """Whether `mask` implies causality for lq queries and lk keys (see `implied_causality`;
    None: the mask says more, or its values are not known before the graph runs), and for
    symbolic sizes the check that the answer holds at other sizes with the size variables it
    reads (None and no names for static ones)."""
    at = known_value_at(mask)
    if at is None:
        return None, None, ()

    def causality(values: dict | None):
        """`implied_causality` with the size variables at `values` (None: this trace's)."""
        mask_values = at(values)
        return None if mask_values is None else implied_causality(mask_values, bound(lq, values), bound(lk, values))

    causal = causality(None)
    names = {name for d in (*mask.shape, lq, lk) if isinstance(d, SymSize) for name in variables(d.polynomial)}
    if causal is None or not names:
        return causal, None, ()
    last = {}

    def check(values: dict) -> bool:
        key = tuple(sorted(values.items()))
        if key not in last:
            last.clear()
            last[key] = causality(values) is causal
        return last[key]
    return causal, check, names


def _rewrite(node, inputs, decided: dict):
    """`node` without its mask where that mask implies causality or keeps every key; `decided`
    holds the decisions taken on this graph, by mask and sizes: the layers of a model share one
    mask, computed once, and one check (once a new size)."""
    if node.definition.name not in ATTENTION:
        return None
    args = arguments_of(node)
    if "is_causal" not in args:     # a plugin's attention operator of another signature
        return None
    mask, lq, lk = args.get("mask"), args["q"].shape[-2], args["k"].shape[-2]
    if not isinstance(mask, Tensor):
        return None
    key = (id(mask), _form(lq), _form(lk))
    if key not in decided:
        decided[key] = _decide(mask, lq, lk)
    causal, check, names = decided[key]
    if causal is None:
        return None
    if check is not None:
        note_check(check, names)
    return remake(node, inputs, mask=None, is_causal=args["is_causal"] or causal)


class CausalMasks(GraphPass):
    """Drop each attention mask known before the graph runs that keeps every key, or exactly
    the causal keys (then setting `is_causal`)."""

    name = "causal_masks"
    opt_level = 1
    stage = "precision"     # after constant folding has made the masks constants

    def transform(self, graph, ctx):
        decided = {}
        return rebuild(graph, lambda node, inputs: _rewrite(node, inputs, decided))
