"""`softmax(q @ k^T * scale [+ mask]) @ v` as one `attention` operator, where a plugin
provides one taking `(q, k, v, mask=..., scale=...)`.

The scale is a Python number or a one-element constant tensor, applied by `mul` (or `div` by
its inverse); k^T is any transpose or permute (k is that permute with the last two dims
swapped back); softmax runs over the last dim. The mask is added, or selected by `where` (or
masked_fill) with a fill of -inf (a bool keep-mask) or of at most -1e30 (added: float32
scores absorb it exactly). The mask must not widen the scores nor change their dtype.
One difference remains: a query whose keys are all masked by -inf gets zeros from the
operator (as scaled_dot_product_attention returns) where the written-out softmax gives NaN.

A mask known before the graph runs (a constant, or generated from no data) that is exactly
the causal one (keep key j for query i where j <= i: True, or 0 against at most -1e30) becomes
`is_causal`, so that templates skip the masked blocks instead of reading the mask. Keys and
values repeated per query head (`repeat_kv` of Hugging Face's grouped-query attention:
unsqueeze, expand, reshape) are read through the operator's own grouping instead
(`grouped_attention`).
"""
from __future__ import annotations

import inspect

from kiln.graph import OperatorError, known_value
from kiln.passes.edit import arguments_of
from kiln.passes.pattern import op, rewrite_pattern, wildcard
from kiln.passes.provided import provided
from kiln.tensor import Tensor

from kiln_ops_builtin.patterns.shape_chains import PERMUTES, RESHAPES, permutation


def _key(m):
    """k, where k^T is the matched transpose or permute of `_k` (a permute of `_k` itself when
    the transpose was composed with an earlier permute, as of heads split from a linear)."""
    order = permutation(m[_kt])
    order[-2:] = order[-1], order[-2]
    if order == sorted(order):
        return m[_k]
    permute = provided("permute")
    return None if permute is None else permute(m[_k], order)


def _last_dim_softmax(node) -> bool:
    return node.attrs.get("dim") in (-1, node.inputs[0].ndim - 1) and node.attrs.get("dtype") is None


def _scale(node) -> float | None:
    """The factor `scores * s`, `s * scores` or `scores / s` applies (s a number or a constant
    one-element tensor), or None."""
    values = list(arguments_of(node).values())
    if len(values) < 2 or any(v is not None for v in values[2:]):   # div's rounding_mode
        return None
    values = values[:2]
    scores = node.inputs[0]
    if node.definition.name == "div" and values[0] is not scores:
        return None
    (s,) = [v for v in values if v is not scores]
    if isinstance(s, Tensor):
        if s.is_symbolic or s.numel() != 1:
            return None
        s = s.torch().item()
    if not isinstance(s, (int, float)) or isinstance(s, bool) or s == 0:
        return None
    return float(s) if node.definition.name == "mul" else 1.0 / float(s)


_q, _k, _v, _mask = wildcard(), wildcard(), wildcard(), wildcard()
_kt = op(PERMUTES, _k, where=lambda n: n.inputs[0].ndim >= 2)
_scores = op("matmul", _q, _kt)
_scaled = op(("mul", "div"), _scores)
_masked = op("add", _scaled, _mask, commutative=True, where=lambda n: n.attrs.get("alpha", 1) == 1)
_filled = op("where", _mask, _scaled, where=lambda n: len(n.inputs) == 2)
_plain = op("matmul", op("softmax", _scaled, where=_last_dim_softmax), _v)
_with_mask = op("matmul", op("softmax", _masked, where=_last_dim_softmax), _v)
_with_fill = op("matmul", op("softmax", _filled, where=_last_dim_softmax), _v)
_recast = op("cast", _filled, where=lambda n: n.outputs[0].dtype == n.inputs[0].dtype)   # masked_fill's
_with_recast_fill = op("matmul", op("softmax", _recast, where=_last_dim_softmax), _v)

ABSORBED_FILL = -1e30


def _same_scores(m, node) -> bool:
    """Whether masking by `node` keeps the scores' shape and dtype."""
    scores, masked = m[_scaled].outputs[0], node.outputs[0]
    return masked.shape == scores.shape and masked.dtype == scores.dtype


def _is_causal_mask(mask: Tensor, lq: int, lk: int) -> bool:
    """Whether `mask` (broadcast to [..., lq, lk]), a constant or generated from no data,
    keeps exactly the keys j <= i of each query i: a bool mask True there and False elsewhere,
    or an additive one 0 there and at most ABSORBED_FILL elsewhere."""
    if mask.ndim < 2 or mask.shape[-2:] not in ((lq, lk), (1, lk)):
        return False
    values = known_value(mask)
    if values is None:
        return False
    import torch
    keep = torch.ones(lq, lk, dtype=torch.bool, device=values.device).tril()
    if values.dtype == torch.bool:
        return bool((values == keep).all())
    return bool(((values == 0) == keep).all() and (values[..., ~keep] <= ABSORBED_FILL).all())


def _attention(m, root, mask):
    """The attention operator replacing `root`, or None where none is provided or it does
    not compute exactly what `root` does (its shapes, dtypes or signature differ)."""
    attention, scale, key = provided("attention"), _scale(m[_scaled]), _key(m)
    if attention is None or scale is None or key is None:
        return None
    params = inspect.signature(attention.definition).parameters
    kwargs = {"scale": scale}
    if mask is not None and _is_causal_mask(mask, m[_q].shape[-2], key.shape[-2]):
        kwargs["is_causal"] = True
    elif mask is not None:
        kwargs["mask"] = mask
    if not set(kwargs) <= set(params):
        return None
    try:
        out = attention(m[_q], key, m[_v], **kwargs)
    except OperatorError:
        return None
    want = m[root].outputs[0]
    return out if out.shape == want.shape and out.dtype == want.dtype else None


@rewrite_pattern("attention", _plain)
def attention(m):
    """softmax(q @ k^T * scale) @ v: one attention operator."""
    return _attention(m, _plain, None)


@rewrite_pattern("masked_attention", _with_mask)
def masked_attention(m):
    """softmax(q @ k^T * scale + mask) @ v: one attention operator."""
    if not m[_mask].dtype.is_float or not _same_scores(m, m[_masked]):   # a bool added counts 1
        return None
    return _attention(m, _with_mask, m[_mask])


def _filled_attention(m, root):
    """softmax(where(keep, q @ k^T * scale, fill)) @ v (or masked_fill(scores, ~keep, fill)):
    one attention operator with a bool keep-mask (fill -inf) or an additive one."""
    node = m[_filled]
    args = arguments_of(node)
    keeps = args["input"] is m[_scaled].outputs[0]
    fill = args["other"] if keeps else args["input"]
    where, logical_not = provided("where"), provided("logical_not")
    if not _same_scores(m, node) or not isinstance(fill, (int, float)) or where is None:
        return None
    if fill == float("-inf"):
        if keeps:
            return _attention(m, root, m[_mask])
        return None if logical_not is None else _attention(m, root, logical_not(m[_mask]))
    if fill > ABSORBED_FILL:
        return None
    additive = where(m[_mask], 0.0, fill) if keeps else where(m[_mask], fill, 0.0)
    return _attention(m, root, additive)


@rewrite_pattern("filled_attention", _with_fill)
def filled_attention(m):
    """softmax(where(keep, q @ k^T * scale, fill)) @ v: one attention operator."""
    return _filled_attention(m, _with_fill)


@rewrite_pattern("recast_filled_attention", _with_recast_fill)
def recast_filled_attention(m):
    """softmax(masked_fill(q @ k^T * scale, ~keep, fill)) @ v: one attention operator."""
    return _filled_attention(m, _with_recast_fill)


def _repeated(t: Tensor) -> Tensor | None:
    """x where `t` is x [..., H, L, D] repeated per head to [..., H * R, L, D] as
    reshape(expand(unsqueeze(x, -3))) (head h of `t` is head h // R of x), else None."""
    chain = []
    for names in (RESHAPES, ("expand",), ("unsqueeze",)):
        if t.trace is None or t.trace[0].definition.name not in names:
            return None
        chain.append(t)
        t = t.trace[0].inputs[0]
    (out, expanded, unsqueezed), x = chain, t
    lead, (h, length, d) = x.shape[:-3], x.shape[-3:]
    if x.ndim < 3 or unsqueezed.shape != lead + (h, 1, length, d):
        return None
    repeats = expanded.shape[-3]
    ok = expanded.shape == lead + (h, repeats, length, d) and out.shape == lead + (h * repeats, length, d)
    return x if ok else None


_q2, _k2, _v2 = wildcard(), wildcard(), wildcard()
_grouped = op("attention", _q2, op(RESHAPES, _k2), op(RESHAPES, _v2))


@rewrite_pattern("grouped_attention", _grouped)
def grouped_attention(m):
    """attention(q, repeat(k), repeat(v)) for keys and values repeated per query head is
    attention(q, k, v): the operator reads key/value head h // R for query head h itself."""
    node = m[_grouped]
    k, v = _repeated(node.inputs[1]), _repeated(node.inputs[2])
    if k is None or v is None or k.shape[-3] != v.shape[-3]:
        return None
    kwargs = {n: a for n, a in arguments_of(node).items() if n not in ("q", "k", "v", "mask")}
    if len(node.inputs) > 3:
        kwargs["mask"] = node.inputs[3]
    out = node.definition(m[_q2], k, v, **kwargs)
    want = node.outputs[0]
    return out if out.shape == want.shape and out.dtype == want.dtype else None


ATTENTION_PATTERNS = (masked_attention, filled_attention, recast_filled_attention, attention, grouped_attention)
