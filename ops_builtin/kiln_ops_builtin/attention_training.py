"""Attention for training: a forward that also returns each query row's log-sum-exp, and the
backward that recomputes the probabilities from it (FlashAttention's split of the work).

`attention_forward(q, k, v, scale, is_causal, mask)` gives (out, lse) for q [..., Lq, D],
k [..., Lk, D] and v [..., Lk, Dv] with equal leading dims (grouped-query attention is expanded
by the caller):
out = softmax(q k^T * scale) v in q's dtype, lse = log(sum_j exp(s_ij)) over the row's kept scores
in float32. `attention_backward(dout, q, k, v, out, lse, scale, is_causal, mask)` gives (dq, dk, dv)
from P = exp(S - lse), dS = P * (dout v^T - rowsum(dout * out)): dq = scale dS k,
dk = scale dS^T q, dv = P^T dout. Sums run in float32 for 16-bit inputs and each gradient rounds
once to the input's dtype. `is_causal` keeps key j for query i where j <= i (top-left aligned, as
PyTorch); a bool `mask` broadcasting to the scores [..., Lq, Lk] keeps the keys where it is
True. A row whose keys are all masked has lse -inf, output zeros and zero gradients.

Saving lse (4 bytes a row) instead of the probabilities (4 Lk bytes a row) is what lets a fused
kernel train attention in memory linear in the sequence length.
"""
from __future__ import annotations

import math

from kiln import dtypes
from kiln.graph import OperatorError, operator
from kiln.ir import cast, compute, eq, exp, log, reduce, select

from kiln_ops_builtin.common import accumulator_type, broadcast_load, broadcast_shape, check_dtype

NEG_INF = float("-inf")


def _check(op: str, q, k, v, scale, mask) -> float:
    for t in (q, k, v):
        check_dtype(op, t, dtypes.FLOATS, "a floating-point type")
    if len({q.dtype, k.dtype, v.dtype}) > 1:
        raise OperatorError(f"{op}: q, k and v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if (not q.ndim == k.ndim == v.ndim or q.ndim < 2 or not q.shape[:-2] == k.shape[:-2] == v.shape[:-2]
            or q.shape[-1] != k.shape[-1] or k.shape[-2] != v.shape[-2]):
        raise OperatorError(f"{op}: shapes q {q.shape}, k {k.shape}, v {v.shape} do not fit "
                            "q [..., Lq, D], k [..., Lk, D], v [..., Lk, Dv] with equal leading dims")
    if 0 in q.shape or 0 in k.shape or 0 in v.shape:
        raise OperatorError(f"{op}: empty shapes q {q.shape}, k {k.shape}, v {v.shape} are not supported")
    scores = q.shape[:-1] + k.shape[-2:-1]
    if mask is not None and (not mask.dtype.is_bool or broadcast_shape(op, mask.shape, scores) != scores):
        raise OperatorError(f"{op}: mask {mask.dtype}{list(mask.shape)} must be bool and broadcast to the "
                            f"scores' shape {scores}")
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


def _scores(q, k, scale: float, is_causal: bool, mask):
    """The float32 scores q k^T * scale, -inf where the causal mask or `mask` drops a key."""
    acc = accumulator_type(q.dtype)
    d = q.shape[-1]

    def score(*idx):
        b, i, j = idx[:-2], idx[-2], idx[-1]
        s = reduce([d], lambda r: cast(q[b + (i, r)], acc) * cast(k[b + (j, r)], acc), dtype=acc) * scale
        if mask is not None:
            s = select(broadcast_load(mask, idx, shape), s, NEG_INF)
        return select(j <= i, s, NEG_INF) if is_causal else s

    shape = q.shape[:-1] + k.shape[-2:-1]
    return compute(shape, score, dtype=acc)


@operator("attention_forward")
def attention_forward(q, k, v, scale=None, is_causal=False, mask=None):
    """(out, lse): softmax(q k^T * scale) v in q's dtype and the float32 log-sum-exp of each
    query's scores, for q [..., Lq, D], k [..., Lk, D], v [..., Lk, Dv]; a bool `mask` keeps
    the keys where True."""
    scale = _check("attention_forward", q, k, v, scale, mask)
    acc = accumulator_type(q.dtype)
    scores = _scores(q, k, scale, is_causal, mask)
    rows, lk = scores.shape[:-1], k.shape[-2]
    high = compute(rows, lambda *o: reduce([lk], lambda j: scores[o + (j,)], "max", acc), dtype=acc)
    # A fully masked row has maximum -inf; shifting it by 0 makes every exp 0 and its sum 0.
    shift = compute(rows, lambda *o: select(eq(high[o], NEG_INF), 0.0, high[o]), dtype=acc)
    total = compute(rows, lambda *o: reduce([lk], lambda j: exp(scores[o + (j,)] - shift[o]), dtype=acc), dtype=acc)

    def element(*idx):
        row, e = idx[:-1], idx[-1]
        weighted = reduce([lk], lambda j: exp(scores[row + (j,)] - shift[row])
                          * cast(v[row[:-1] + (j, e)], acc), dtype=acc)
        return select(eq(total[row], 0.0), 0.0, weighted / total[row])

    out = compute(rows + v.shape[-1:], element, dtype=q.dtype)
    lse = compute(rows, lambda *o: select(eq(total[o], 0.0), NEG_INF, shift[o] + log(total[o])), dtype=acc)
    return out, lse


@operator("attention_backward")
def attention_backward(dout, q, k, v, out, lse, scale=None, is_causal=False, mask=None):
    """(dq, dk, dv) of `attention_forward`'s output, given its gradient `dout`, its inputs, its
    output `out` and log-sum-exp `lse`."""
    scale = _check("attention_backward", q, k, v, scale, mask)
    if dout.shape != out.shape or out.shape != q.shape[:-1] + v.shape[-1:] or lse.shape != q.shape[:-1]:
        raise OperatorError(f"attention_backward: dout {dout.shape}, out {out.shape} and lse {lse.shape} do "
                            f"not fit q {q.shape}, v {v.shape} (out [..., Lq, Dv], lse [..., Lq])")
    acc = accumulator_type(q.dtype)
    scores = _scores(q, k, scale, is_causal, mask)
    lq, lk, dv_ = q.shape[-2], k.shape[-2], v.shape[-1]
    up = lambda t, i: cast(t[i], acc)
    delta = compute(q.shape[:-1], lambda *o: reduce([dv_], lambda e: up(dout, o + (e,)) * up(out, o + (e,)),
                                                     dtype=acc), dtype=acc)

    def probability(*idx):
        row = idx[:-1]
        live = cast(lse[row], acc)
        return select(eq(live, NEG_INF), 0.0, exp(scores[idx] - live))

    p = compute(scores.shape, probability, dtype=acc)

    def score_grad(*idx):
        b, i, j = idx[:-2], idx[-2], idx[-1]
        dp = reduce([dv_], lambda e: up(dout, b + (i, e)) * up(v, b + (j, e)), dtype=acc)
        return p[idx] * (dp - delta[b + (i,)])

    ds = compute(scores.shape, score_grad, dtype=acc)

    def dq(*idx):
        b, i, r = idx[:-2], idx[-2], idx[-1]
        return reduce([lk], lambda j: ds[b + (i, j)] * up(k, b + (j, r)), dtype=acc) * scale

    def dk(*idx):
        b, j, r = idx[:-2], idx[-2], idx[-1]
        return reduce([lq], lambda i: ds[b + (i, j)] * up(q, b + (i, r)), dtype=acc) * scale

    def dv(*idx):
        b, j, e = idx[:-2], idx[-2], idx[-1]
        return reduce([lq], lambda i: p[b + (i, j)] * up(dout, b + (i, e)), dtype=acc)

    return (compute(q.shape, dq, dtype=q.dtype), compute(k.shape, dk, dtype=k.dtype),
            compute(v.shape, dv, dtype=v.dtype))
