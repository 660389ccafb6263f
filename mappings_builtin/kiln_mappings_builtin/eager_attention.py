"""Attention written out in torch operations, as transformers' "eager" attention does, made one
`scaled_dot_product_attention` in training graphs (a graph rewrite, before AOTAutograd):

    scores = matmul(q, k.transpose(-2, -1)) * scale     (or / d, or no scale)
    scores = scores + mask                               (optional)
    p = softmax(scores, dim=-1, dtype=...).to(q.dtype)   (.to or .type, optional)
    p = dropout(p, p=0.0)                                (optional; only p == 0)
    out = matmul(p, v)

Traced as written, the forward saves the probabilities for the backward (float32, [B, H, L, L]
per layer); as one attention, it saves what the attention's decomposition saves (Kiln's fused
pair on CUDA: the output and a log-sum-exp per row). The mask must be a value the graph computes
from constants (`constant_value`), and either all zeros (no mask) or causal: 0 at and below
the diagonal, at most float16's lowest (-65504) above it, where softmax gives those scores weight
0 as `is_causal` does. A mask from an input (padding) leaves the graph as it is, as does any
intermediate read by something else (the probabilities returned to the caller). Under autocast,
where q and k may be float32 (a float32 rotary embedding) while the matmuls compute in the
autocast dtype, q, k and v are cast to that dtype before the attention.
"""
from __future__ import annotations

import operator

import torch
import torch.nn.functional as F

from kiln.frontend.torch import register_graph_rewrite
from kiln.frontend.torch.graph_rewrites import ancestors, called, constant_value, erase_unused

MATMULS = (torch.matmul, operator.matmul)
MASKED_BELOW = torch.finfo(torch.float16).min


def _value(node):
    return node.meta.get("example_value") if isinstance(node, torch.fx.Node) else None


def _call(node, *targets) -> bool:
    return isinstance(node, torch.fx.Node) and any(called(node) is t for t in targets)


def _only_user(node):
    return next(iter(node.users)) if len(node.users) == 1 else None


def _keys(kt):
    """k, where `kt` is k with its last two dimensions swapped."""
    if not _call(kt, torch.transpose, torch.Tensor.transpose) or len(kt.args) != 3:
        return None
    rank = _value(kt).dim()
    return kt.args[0] if sorted(d % rank for d in kt.args[1:]) == [rank - 2, rank - 1] else None


def _scaled_scores(node):
    """(q, k, scale, the nodes from q @ k^T to `node`) where `node` is q @ k^T, times or divided
    by a number (or neither), read by nothing else."""
    scale, nodes = 1.0, [node]
    if node.kwargs:             # torch.div's rounding_mode, an out= tensor
        return None
    if _call(node, operator.mul, torch.mul) and len(node.args) == 2:
        number = [a for a in node.args if isinstance(a, (int, float))]
        if len(number) != 1:
            return None
        scale, node = float(number[0]), next(a for a in node.args if isinstance(a, torch.fx.Node))
        nodes.append(node)
    elif _call(node, operator.truediv, torch.div) and len(node.args) == 2 and isinstance(node.args[1], (int, float)):
        scale, node = 1.0 / node.args[1], node.args[0]
        nodes.append(node)
    if not _call(node, *MATMULS) or any(len(n.users) != 1 for n in nodes):
        return None
    q, kt = node.args
    k = _keys(kt)
    return None if k is None else (q, k, scale, nodes + [kt])


def _mask_kind(mask, length_q: int, length_k: int):
    """'none' (all zeros), 'causal', or None (anything else)."""
    if mask is None:
        return "none"
    value = constant_value(mask)
    if not isinstance(value, torch.Tensor) or not value.is_floating_point() or value.dim() < 2:
        return None
    if tuple(value.shape[-2:]) != (length_q, length_k):
        return None
    if not value.any():
        return "none"
    below = torch.ones(length_q, length_k, dtype=torch.bool, device=value.device).tril()
    if length_q == length_k and not value[..., below].any() and (value[..., ~below] <= MASKED_BELOW).all():
        return "causal"
    return None


def _dropped_nothing(node) -> bool:
    p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
    training = node.args[2] if len(node.args) > 2 else node.kwargs.get("training", True)
    return isinstance(p, (int, float)) and (p == 0 or training is False)


def _matmul_dtype(values):
    """The dtype the two matmuls compute in, given q, k, v and the output: their one dtype, or
    under autocast (the graph runs only under the autocast state it was traced in, as dynamo
    guards it) the autocast dtype where the output has it (q and k may be float32 after a
    float32 rotary embedding, v not); else None."""
    dtypes = {t.dtype for t in values}
    if len(dtypes) == 1:
        return dtypes.pop()
    device = values[0].device.type
    output = values[-1].dtype
    if torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) == output \
            and all(t.is_floating_point() for t in values):
        return output
    return None


@register_graph_rewrite(F.softmax, torch.softmax, torch.Tensor.softmax)
def eager_attention(softmax) -> bool:
    """The attention around `softmax` as one scaled_dot_product_attention (module doc)."""
    dim = softmax.args[1] if len(softmax.args) > 1 else softmax.kwargs.get("dim")
    scores, chain = softmax.args[0], [softmax]
    if _value(scores) is None or dim not in (-1, _value(scores).dim() - 1) or len(scores.users) != 1:
        return False
    mask = None
    if _call(scores, operator.add, torch.add) and len(scores.args) == 2:
        for s, m in (scores.args, scores.args[::-1]):
            if isinstance(m, torch.fx.Node) and _scaled_scores(s) is not None:
                chain.append(scores)
                scores, mask = s, m
                break
    found = _scaled_scores(scores)
    if found is None:
        return False
    q, k, scale, producers = found
    chain += producers
    node = softmax
    while (after := _only_user(node)) is not None and not _call(after, *MATMULS):
        cast = _call(after, torch.Tensor.to, torch.Tensor.type) and len(after.args) == 2 \
            and isinstance(after.args[1], torch.dtype)
        if not cast and not (_call(after, F.dropout) and _dropped_nothing(after)):
            return False
        chain.append(after)
        node = after
    if after is None or after.args[0] is not node or len(after.args) != 2 or after.kwargs:
        return False
    v = after.args[1]
    values = [_value(t) for t in (q, k, v, after)]
    if any(t is None or t.dim() != 4 for t in values):
        return False
    dtype = _matmul_dtype(values)
    kind = _mask_kind(mask, values[0].shape[-2], values[1].shape[-2])
    if dtype is None or kind is None:
        return False
    graph = softmax.graph
    with graph.inserting_before(after):
        q, k, v = (t if value.dtype == dtype else graph.call_method("to", (t, dtype))
                   for t, value in zip((q, k, v), values))
        attention = graph.call_function(F.scaled_dot_product_attention, (q, k, v),
                                        {"is_causal": kind == "causal", "scale": scale})
    attention.meta = dict(after.meta)
    after.replace_all_uses_with(attention)
    graph.erase_node(after)
    erase_unused(chain)
    if mask is not None and not mask.users:
        erase_unused(ancestors(mask))
    return True

