"""Products and distances composed from matmul: outer, dot, mv, addmv, addr, addbmm, bilinear,
einsum (lowered to permute, reshape and batched matmul), cdist, cosine_similarity and
pairwise_distance."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kiln import ops
from kiln.frontend.torch import register_function, register_method


def _scaled(t, factor):
    return t if factor == 1 else ops.mul(t, factor)


def plus_scaled(product, input, beta):
    """product + beta * input; beta 0 ignores input (its NaN and inf too), as PyTorch does."""
    if beta == 0:
        return ops.broadcast_to(product, torch.broadcast_shapes(tuple(product.shape), tuple(input.shape)))
    return ops.add(product, _scaled(input, beta))


@register_function(torch.outer, torch.ger)
@register_method("outer", "ger")
def outer(input, vec2):
    return ops.mul(ops.unsqueeze(input, 1), ops.unsqueeze(vec2, 0))


@register_function(torch.dot, torch.inner, torch.vdot, check=lambda a, b, **k: a.ndim == 1 and b.ndim == 1)
@register_method("dot", "inner", "vdot", check=lambda a, b, **k: a.ndim == 1 and b.ndim == 1)
def dot(input, other, *, out=None):
    return ops.matmul(input, other)


@register_function(torch.mv)
@register_method("mv")
def mv(input, vec, *, out=None):
    return ops.matmul(input, vec)


@register_function(torch.addmv)
@register_method("addmv")
def addmv(input, mat, vec, *, beta=1, alpha=1, out=None):
    return plus_scaled(_scaled(ops.matmul(mat, vec), alpha), input, beta)


@register_function(torch.addr)
@register_method("addr")
def addr(input, vec1, vec2, *, beta=1, alpha=1, out=None):
    return plus_scaled(_scaled(outer(vec1, vec2), alpha), input, beta)


@register_function(torch.addbmm)
@register_method("addbmm")
def addbmm(input, batch1, batch2, *, beta=1, alpha=1, out=None):
    return plus_scaled(_scaled(ops.sum(ops.matmul(batch1, batch2), 0), alpha), input, beta)


@register_function(F.bilinear, torch.bilinear)
def bilinear(input1, input2, weight, bias=None):
    """y[.., o] = sum_ij x1[.., i] W[o, i, j] x2[.., j] + b[o]."""
    out_features, n1, n2 = weight.shape
    lead = input1.shape[:-1]
    x1 = ops.reshape(input1, (-1, n1))
    x2 = ops.reshape(input2, (-1, n2))
    # (B, n1) @ (n1, O * n2) -> (B, O, n2), then the dot with x2 over n2
    w = ops.reshape(ops.permute(weight, (1, 0, 2)), (n1, out_features * n2))
    left = ops.reshape(ops.matmul(x1, w), (-1, out_features, n2))
    y = ops.squeeze(ops.matmul(left, ops.unsqueeze(x2, -1)), -1)
    y = y if bias is None else ops.add(y, bias)
    return ops.reshape(y, tuple(lead) + (out_features,))


# ---------------------------------------------------------------- einsum

def _einsum_terms(equation: str, operands):
    """(input letter strings, output letters) with '...' replaced by fresh capital letters."""
    equation = equation.replace(" ", "")
    lhs, arrow, rhs = equation.partition("->")
    terms = lhs.split(",")
    free = iter(c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ" if c not in equation)
    widest = max((t.ndim - len(s.replace("...", "")) for s, t in zip(terms, operands) if "..." in s), default=0)
    ellipsis = "".join(next(free) for _ in range(widest))
    expanded = []
    for s, t in zip(terms, operands):
        if "..." in s:
            s = s.replace("...", ellipsis[widest - (t.ndim - len(s.replace("...", ""))):])
        expanded.append(s)
    if not arrow:
        counts = {c: "".join(expanded).count(c) for c in "".join(expanded)}
        rhs = ellipsis + "".join(sorted(c for c, n in counts.items() if n == 1 and c not in ellipsis))
    else:
        rhs = rhs.replace("...", ellipsis)
    return expanded, rhs


def _einsum_supported(equation, *operands) -> bool:
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    if not isinstance(equation, str):
        return False
    terms, _ = _einsum_terms(equation, operands)
    return len(terms) == len(operands) and all(len(set(t)) == len(t) for t in terms)


def _sum_letters(t, letters: str, drop: set):
    dims = [k for k, c in enumerate(letters) if c in drop]
    if not dims:
        return t, letters
    return ops.sum(t, dims), "".join(c for c in letters if c not in drop)


def _contract(a, la: str, b, lb: str, keep: set):
    """The product of a and b summed over their shared letters that `keep` lacks."""
    a, la = _sum_letters(a, la, {c for c in la if c not in lb and c not in keep})
    b, lb = _sum_letters(b, lb, {c for c in lb if c not in la and c not in keep})
    batch = [c for c in la if c in lb and c in keep]
    contracted = [c for c in la if c in lb and c not in keep]
    left = [c for c in la if c not in lb]
    right = [c for c in lb if c not in la]
    size = {c: n for c, n in zip(la + lb, tuple(a.shape) + tuple(b.shape))}

    def arranged(t, letters, order, rows, cols):
        t = ops.permute(t, [letters.index(c) for c in order])
        return ops.reshape(t, tuple(size[c] for c in batch) + (rows, cols))

    def extent(cs):
        return math.prod(size[c] for c in cs)

    am = arranged(a, la, batch + left + contracted, extent(left), extent(contracted))
    bm = arranged(b, lb, batch + contracted + right, extent(contracted), extent(right))
    product = ops.matmul(am, bm)
    return ops.reshape(product, tuple(size[c] for c in batch + left + right)), "".join(batch + left + right)


@register_function(torch.einsum, check=_einsum_supported)
def einsum(equation, *operands):
    """Operands folded left to right by batched matmul, each summing away the letters nothing
    later needs (no repeated letters within one operand)."""
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    terms, rhs = _einsum_terms(equation, operands)
    result, letters = operands[0], terms[0]
    for k in range(1, len(operands)):
        keep = set(rhs) | set("".join(terms[k + 1:]))
        result, letters = _contract(result, letters, operands[k], terms[k], keep)
    result, letters = _sum_letters(result, letters, {c for c in letters if c not in rhs})
    order = [letters.index(c) for c in rhs]
    return ops.permute(result, order) if order != list(range(len(order))) else result


# ---------------------------------------------------------------- distances

@register_function(F.cosine_similarity, torch.cosine_similarity)
def cosine_similarity(x1, x2, dim=1, eps=1e-8):
    """x1 . x2 / (max(|x1|, eps) * max(|x2|, eps)) along `dim`, as PyTorch computes it."""
    n1 = ops.clamp(ops.sqrt(ops.sum(ops.mul(x1, x1), dim)), min=eps)
    n2 = ops.clamp(ops.sqrt(ops.sum(ops.mul(x2, x2), dim)), min=eps)
    return ops.div(ops.sum(ops.mul(x1, x2), dim), ops.mul(n1, n2))


def _p_norm(diff, p, dim, keepdim=False):
    magnitude = ops.abs(diff)
    if p == math.inf:
        return ops.amax(magnitude, dim, keepdim)
    if p == 0:
        return ops.sum(ops.cast(ops.ne(diff, 0), diff.dtype), dim, keepdim)
    if p == 1:
        return ops.sum(magnitude, dim, keepdim)
    if p == 2:
        return ops.sqrt(ops.sum(ops.mul(diff, diff), dim, keepdim))
    return ops.pow(ops.sum(ops.pow(magnitude, p), dim, keepdim), 1 / p)


@register_function(F.pairwise_distance, torch.pairwise_distance)
def pairwise_distance(x1, x2, p=2.0, eps=1e-6, keepdim=False):
    return _p_norm(ops.add(ops.sub(x1, x2), eps), p, -1, keepdim)


@register_function(torch.cdist)
def cdist(x1, x2, p=2.0, compute_mode=None):
    """The p-distance of every row of x1 (.., P, M) to every row of x2 (.., R, M): (.., P, R)."""
    diff = ops.sub(ops.unsqueeze(x1, -2), ops.unsqueeze(x2, -3))
    return _p_norm(diff, p, -1)
