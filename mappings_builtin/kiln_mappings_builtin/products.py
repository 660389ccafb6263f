"""Products and distances composed from matmul: outer, dot, mv, addmv, addr, addbmm, bilinear,
einsum (lowered to diagonals, permute, reshape and batched matmul), cdist, cosine_similarity,
pairwise_distance, and the grouped matmul of mixture-of-experts layers (`torch._grouped_mm`,
`F.grouped_mm`, and transformers' fallback operator for dtypes those do not take)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kiln import ops
from kiln.frontend.torch import register_function, register_method

from kiln_mappings_builtin.arrange import diagonal_of
from kiln_mappings_builtin.common import counted


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


@register_function(torch.dot, torch.vdot, check=lambda a, b, **k: a.ndim == 1 and b.ndim == 1)
@register_method("dot", "vdot", check=lambda a, b, **k: a.ndim == 1 and b.ndim == 1)
def dot(input, other, *, out=None):
    return ops.matmul(input, other)


@register_function(torch.inner)
@register_method("inner")
def inner(input, other, *, out=None):
    """The sum over the last dims: shape input.shape[:-1] + other.shape[:-1] (0-d: a product)."""
    if input.ndim == 0 or other.ndim == 0:
        return ops.mul(input, other)
    k = input.shape[-1]
    a, b = ops.reshape(input, (-1, k)), ops.reshape(other, (-1, k))
    return ops.reshape(ops.matmul(a, ops.transpose(b, 0, 1)), tuple(input.shape[:-1]) + tuple(other.shape[:-1]))


@register_function(torch.kron)
@register_method("kron")
def kron(input, other, *, out=None):
    """out[i * m + k] = input[i] * other[k] in every dim (the ranks padded to match)."""
    n = max(input.ndim, other.ndim)
    a = ops.reshape(input, (1,) * (n - input.ndim) + tuple(input.shape))
    b = ops.reshape(other, (1,) * (n - other.ndim) + tuple(other.shape))
    # interleave: a as (a0, 1, a1, 1, ..), b as (1, b0, 1, b1, ..)
    wide_a = ops.reshape(a, tuple(x for s in a.shape for x in (s, 1)))
    wide_b = ops.reshape(b, tuple(x for s in b.shape for x in (1, s)))
    return ops.reshape(ops.mul(wide_a, wide_b), tuple(p * q for p, q in zip(a.shape, b.shape)))


@register_function(torch.tensordot)
def tensordot(a, b, dims=2, out=None):
    """Sum over dims of a and b (the last `dims` of a with the first of b, or listed pairs)."""
    if isinstance(dims, int):
        da, db = list(range(a.ndim - dims, a.ndim)), list(range(dims))
    else:
        da, db = ([dims[0]] if isinstance(dims[0], int) else list(dims[0])), \
            ([dims[1]] if isinstance(dims[1], int) else list(dims[1]))
    da, db = [d % a.ndim for d in da], [d % b.ndim for d in db]
    sa, sb = list(a.shape), list(b.shape)
    for i, j in zip(da, db):  # size-1 contracted dims broadcast, as in PyTorch
        sa[i] = sb[j] = max(sa[i], sb[j])
    a, b = ops.expand(a, tuple(sa)), ops.expand(b, tuple(sb))
    free_a = [d for d in range(a.ndim) if d not in da]
    free_b = [d for d in range(b.ndim) if d not in db]
    k = math.prod(a.shape[d] for d in da)
    am = ops.reshape(ops.permute(a, free_a + da), (math.prod(a.shape[d] for d in free_a), k))
    bm = ops.reshape(ops.permute(b, db + free_b), (k, math.prod(b.shape[d] for d in free_b)))
    return ops.reshape(ops.matmul(am, bm), tuple(a.shape[d] for d in free_a) + tuple(b.shape[d] for d in free_b))


@register_function(torch.linalg.cross, torch.cross)
@register_method("cross")
def cross(input, other, dim=None, *, out=None):
    """The cross product of 3-vectors along `dim` (linalg.cross: -1; torch.cross: the first dim of size 3)."""
    shape = torch.broadcast_shapes(tuple(input.shape), tuple(other.shape))
    if dim is None:
        dim = next(k for k, s in enumerate(shape) if s == 3)
    input, other = ops.broadcast_to(input, shape), ops.broadcast_to(other, shape)
    a = [ops.slice(input, dim, k, k + 1) for k in range(3)]
    b = [ops.slice(other, dim, k, k + 1) for k in range(3)]
    parts = [ops.sub(ops.mul(a[(k + 1) % 3], b[(k + 2) % 3]), ops.mul(a[(k + 2) % 3], b[(k + 1) % 3]))
             for k in range(3)]
    return ops.cat(parts, dim)


@register_function(torch.linalg.vecdot)
def vecdot(x, y, *, dim=-1, out=None):
    product = ops.mul(x, y)
    if product.shape[dim] == 0:
        shape = tuple(s for k, s in enumerate(product.shape) if k != dim % product.ndim)
        return ops.full(shape, 0, dtype=product.dtype, device=product.device)
    return ops.sum(product, dim)


@register_function(torch.linalg.matrix_power, torch.matrix_power, check=lambda input, n, **k: n >= 0)
@register_method("matrix_power", check=lambda input, n: n >= 0)
def matrix_power(input, n, *, out=None):
    """By repeated squaring (negative powers need an inverse: not mapped)."""
    size = input.shape[-1]
    eye = ops.cast(ops.eq(ops.reshape(ops.arange(size, device=input.device), (size, 1)),
                          ops.arange(size, device=input.device)), input.dtype)
    result, base = ops.broadcast_to(eye, tuple(input.shape)), input
    while n:
        if n & 1:
            result = ops.matmul(result, base)
        n >>= 1
        if n:
            base = ops.matmul(base, base)
    return result


@register_function(torch.linalg.multi_dot)
def multi_dot(tensors, *, out=None):
    tensors = list(tensors)
    result = tensors[0]
    for t in tensors[1:]:
        result = ops.matmul(result, t)
    return result


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
    terms, rhs = _einsum_terms(equation, operands)
    if len(terms) != len(operands) or len(set(rhs)) != len(rhs):
        return False
    for letters, t in zip(terms, operands):  # a repeated letter's dims: one size (a diagonal)
        if len(letters) != t.ndim or any(
                len({t.shape[k] for k, c in enumerate(letters) if c == letter}) > 1 for letter in letters):
            return False
    return True


def _diagonals(t, letters: str):
    """An operand whose letters repeat (`'bii'`) as its diagonal over each repeated letter's dims,
    the letter kept once, last (`'bi'`)."""
    for letter in dict.fromkeys(letters):
        while letters.count(letter) > 1:
            first = letters.index(letter)
            second = letters.index(letter, first + 1)
            t = diagonal_of(t, 0, first, second)
            letters = "".join(c for k, c in enumerate(letters) if k not in (first, second)) + letter
    return t, letters


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
    later needs; a letter repeated within one operand (`'ii->i'`, `'bii->b'`) first takes that
    operand's diagonal over its dims."""
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    terms, rhs = _einsum_terms(equation, operands)
    operands, terms = zip(*(_diagonals(t, letters) for t, letters in zip(operands, terms)))
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


def row_groups(mat_a, mat_b, offs=None, bias=None, out_dtype=None) -> bool:
    """The mixture-of-experts form: rows (S, K) by groups of matrices (G, K, N), `offs` the
    groups' cumulative row ends; no bias, and the result in the operands' dtype."""
    return (offs is not None and bias is None and (out_dtype is None or out_dtype == mat_a.dtype)
            and mat_a.ndim == 2 and mat_b.ndim == 3 and offs.ndim == 1 and offs.shape[0] == mat_b.shape[0])


GROUPED_MM_FALLBACK = ("transformers.grouped_mm_fallback", "transformers.grouped_mm_fallback.default")
"""transformers' grouped matmul for dtypes `torch._grouped_mm` does not take (an operator of
transformers' own library, named: Kiln does not import transformers), as dynamo's graphs and
AOTAutograd's call it."""


GROUPED_MM = (torch._grouped_mm, *GROUPED_MM_FALLBACK) + ((F.grouped_mm,) if hasattr(F, "grouped_mm") else ())
"""The grouped matmuls of torch (F.grouped_mm where this torch has it) and of transformers."""


def _groups(rows_of, offs):
    """The group of each row of `rows_of` (S, ...): the number of group ends in `offs` at or
    below it (as many as there are groups for a row past the last end)."""
    rows = ops.arange(rows_of.shape[0], dtype=offs.dtype, device=rows_of.device)
    return counted(offs, rows, True, torch.int64)


@register_function(*GROUPED_MM, check=row_groups)
def grouped_mm(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    """Row s of `mat_a` times the matrix of its group (rows past the last end get zeros, as
    transformers' fallback leaves them)."""
    return ops.grouped_matmul(mat_a, mat_b, _groups(mat_a, offs))


GROUPED_MM_FALLBACK_BACKWARD = ("transformers.grouped_mm_fallback_backward",
                                "transformers.grouped_mm_fallback_backward.default")
"""The backward of transformers' fallback, an operator of its own (what a training step's
backward graph calls)."""


@register_function(*GROUPED_MM_FALLBACK_BACKWARD)
def grouped_mm_fallback_backward(input, weight, offs, grad_output):
    """(grad of input, grad of weight) of `grouped_mm`: each row's gradient times its group's
    matrix transposed; each group's matrix gradient the product of its rows' inputs and
    gradients, as a batched matmul over groups of the gradients masked to each group's rows
    (zeros for an empty group, and for the rows past the last end)."""
    groups = _groups(input, offs)
    grad_input = ops.grouped_matmul(grad_output, ops.transpose(weight, 1, 2), groups)
    ids = ops.arange(weight.shape[0], dtype=groups.dtype, device=input.device)
    mine = ops.eq(ops.unsqueeze(groups, 0), ops.unsqueeze(ids, 1))                   # (G, S)
    masked = ops.where(ops.unsqueeze(mine, -1), ops.unsqueeze(grad_output, 0), 0)
    grad_weight = ops.matmul(ops.unsqueeze(ops.transpose(input, 0, 1), 0), masked)   # (G, K, N)
    return ops.cast(grad_input, input.dtype), ops.cast(grad_weight, weight.dtype)
