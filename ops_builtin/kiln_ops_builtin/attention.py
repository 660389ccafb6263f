"""Scaled dot-product attention: softmax(q k^T * scale + mask) v over the last two dims.

Grouped-query and multi-query attention read key/value head h // (Hq / Hkv) for query head h,
without copying. Scores, their row maximum and sum stay in float32 for 16-bit inputs and the
result rounds once to the input's type, as PyTorch keeps them. A query whose keys are all
masked gets zeros, as PyTorch's scaled_dot_product_attention returns.
"""
from __future__ import annotations

import math

from kiln import dtypes
from kiln.graph import OperatorError, operator
from kiln.ir import cast, compute, eq, exp, reduce, select

from kiln_ops_builtin.common import accumulator_type, broadcast_load, broadcast_shape, check_dtype

NEG_INF = float("-inf")


def _check(q, k, v, mask) -> None:
    for t in (q, k, v):
        check_dtype("attention", t, dtypes.FLOATS, "a floating-point type")
    if len({q.dtype, k.dtype, v.dtype}) > 1:
        raise OperatorError(f"attention: q, k and v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not q.ndim == k.ndim == v.ndim or q.ndim < 2:
        raise OperatorError(f"attention: q {q.shape}, k {k.shape} and v {v.shape} must have one rank, "
                            "at least 2 ([..., heads, length, dim])")
    if q.shape[-1] != k.shape[-1] or k.shape[-2] != v.shape[-2] or k.shape[:-2] != v.shape[:-2]:
        raise OperatorError(f"attention: shapes q {q.shape}, k {k.shape}, v {v.shape} do not fit "
                            "q [..., Hq, Lq, D], k [..., Hkv, Lk, D], v [..., Hkv, Lk, Dv]")
    if 0 in q.shape or 0 in k.shape or 0 in v.shape:
        raise OperatorError(f"attention: empty shapes q {q.shape}, k {k.shape}, v {v.shape} are not supported")
    if q.ndim >= 3 and q.shape[-3] % k.shape[-3]:
        raise OperatorError(f"attention: {q.shape[-3]} query heads are not a multiple of "
                            f"{k.shape[-3]} key/value heads (q {q.shape}, k {k.shape})")
    if mask is not None and not (mask.dtype.is_bool or mask.dtype.is_float):
        raise OperatorError(f"attention: mask has dtype {mask.dtype}; expected bool (True keeps) "
                            "or a floating-point type (added to the scores)")


@operator("attention")
def attention(q, k, v, mask=None, scale=None, is_causal=False):
    """softmax(q @ k^T * scale + mask) @ v for q [..., Hq, Lq, D], k [..., Hkv, Lk, D] and
    v [..., Hkv, Lk, Dv], Hq a multiple of Hkv; leading dims broadcast.

    `mask` broadcasts to the scores [..., Hq, Lq, Lk]: a bool mask keeps where True, a float
    mask is added. `is_causal` keeps key j for query i where j <= i (the lower triangle aligned
    to the top left, as PyTorch). `scale` defaults to 1 / sqrt(D).
    """
    _check(q, k, v, mask)
    acc = accumulator_type(q.dtype)
    (lq, d), lk, dv = q.shape[-2:], k.shape[-2], v.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    heads = q.ndim >= 3
    group = q.shape[-3] // k.shape[-3] if heads else 1
    lead = broadcast_shape("attention", q.shape[:-3], k.shape[:-3]) if heads else ()
    batch = lead + ((q.shape[-3],) if heads else ())
    scores_shape = batch + (lq, lk)
    if mask is not None and broadcast_shape("attention", mask.shape, scores_shape) != scores_shape:
        raise OperatorError(f"attention: mask of shape {mask.shape} does not broadcast to the "
                            f"scores' shape {scores_shape}")
    q_shape, k_shape = lead + q.shape[-3:-2] + (lq, d), lead + k.shape[-3:-2] + (lk, d)
    v_shape = lead + v.shape[-3:-2] + (lk, dv)

    def kv_batch(b):
        return b[:-1] + (b[-1] // group,) if heads else b

    def score(*idx):
        b, i, j = idx[:-2], idx[-2], idx[-1]
        kb = kv_batch(b)
        s = reduce([d], lambda r: cast(broadcast_load(q, b + (i, r), q_shape), acc)
                   * cast(broadcast_load(k, kb + (j, r), k_shape), acc), dtype=acc) * scale
        if mask is not None and mask.dtype.is_bool:
            s = select(broadcast_load(mask, idx, scores_shape), s, NEG_INF)
        elif mask is not None:
            s = s + cast(broadcast_load(mask, idx, scores_shape), acc)
        return select(j <= i, s, NEG_INF) if is_causal else s

    scores = compute(scores_shape, score, dtype=acc)
    # A fully masked row has maximum -inf; shifting it by 0 makes every exp 0 and its sum 0.
    high = compute(batch + (lq,), lambda *o: reduce([lk], lambda j: scores[o + (j,)], "max", acc), dtype=acc)
    shift = compute(batch + (lq,), lambda *o: select(eq(high[o], NEG_INF), 0.0, high[o]), dtype=acc)
    total = compute(batch + (lq,), lambda *o: reduce([lk], lambda j: exp(scores[o + (j,)] - shift[o]), dtype=acc),
                    dtype=acc)

    def element(*idx):
        b, i, e = idx[:-2], idx[-2], idx[-1]
        row = b + (i,)
        weighted = reduce([lk], lambda j: exp(scores[row + (j,)] - shift[row])
                          * cast(broadcast_load(v, kv_batch(b) + (j, e), v_shape), acc), dtype=acc)
        return select(eq(total[row], 0.0), 0.0, weighted / total[row])

    return compute(batch + (lq, dv), element, dtype=q.dtype)
