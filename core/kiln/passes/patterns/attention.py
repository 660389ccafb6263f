"""`softmax(q @ k^T * scale [+ mask]) @ v` as one `attention` operator, where a plugin
provides one taking `(q, k, v, mask=..., scale=...)`.

The scale is a Python number or a one-element constant tensor, applied by `mul` (or `div` by
its inverse); k^T is a transpose or permute swapping the last two dims; softmax runs over the
last dim.
"""
from __future__ import annotations

import inspect

from kiln.passes.edit import arguments_of
from kiln.passes.pattern import op, rewrite_pattern, wildcard
from kiln.passes.patterns.provided import provided
from kiln.passes.patterns.shape_chains import PERMUTES, permutation
from kiln.tensor import Tensor


def _last_dims_swapped(node) -> bool:
    order = permutation(node)
    n = len(order)
    return n >= 2 and order == list(range(n - 2)) + [n - 1, n - 2]


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
_scores = op("matmul", _q, op(PERMUTES, _k, where=_last_dims_swapped))
_scaled = op(("mul", "div"), _scores)
_masked = op("add", _scaled, _mask, commutative=True, where=lambda n: n.attrs.get("alpha", 1) == 1)
_plain = op("matmul", op("softmax", _scaled, where=_last_dim_softmax), _v)
_with_mask = op("matmul", op("softmax", _masked, where=_last_dim_softmax), _v)


def _attention(m, mask):
    attention = provided("attention")
    scale = _scale(m[_scaled])
    if attention is None or scale is None:
        return None
    params = inspect.signature(attention.definition).parameters
    kwargs = {"scale": scale}
    if mask is not None:
        kwargs["mask"] = mask
    if not set(kwargs) <= set(params):
        return None
    return attention(m[_q], m[_k], m[_v], **kwargs)


@rewrite_pattern("attention", _plain)
def attention(m):
    """softmax(q @ k^T * scale) @ v: one attention operator."""
    return _attention(m, None)


@rewrite_pattern("masked_attention", _with_mask)
def masked_attention(m):
    """softmax(q @ k^T * scale + mask) @ v: one attention operator."""
    return _attention(m, m[_mask])


ATTENTION_PATTERNS = (masked_attention, attention)
