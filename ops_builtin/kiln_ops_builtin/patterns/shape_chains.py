"""Chains of reshapes and of transposes collapse into one operator (or none).

A reshape-like operator (reshape, flatten, squeeze, unsqueeze) applied to the output of
another is one reshape of the first input; one that keeps the shape is dropped. Transposes
and permutes compose into one permute; an identity permutation is dropped.
"""
from kiln.passes.layout import permutation
from kiln.passes.pattern import op, rewrite_pattern, wildcard
from kiln.passes.provided import provided

RESHAPES = ("reshape", "flatten", "squeeze", "unsqueeze")
PERMUTES = ("permute", "transpose")


_x = wildcard()
_reshape = op(RESHAPES, _x)
_inner_reshape = op(RESHAPES, _x)
_reshape_chain = op(RESHAPES, _inner_reshape)


@rewrite_pattern("drop_identity_reshape", _reshape)
def drop_identity_reshape(m):
    """A reshape to the shape its input already has is its input."""
    return m[_x] if m[_x].shape == m[_reshape].outputs[0].shape else None


@rewrite_pattern("collapse_reshapes", _reshape_chain)
def collapse_reshapes(m):
    """reshape(reshape(x)) is one reshape of x."""
    reshape = provided("reshape")
    return None if reshape is None else reshape(m[_x], list(m[_reshape_chain].outputs[0].shape))


_permute = op(PERMUTES, _x)
_inner_permute = op(PERMUTES, _x)
_permute_chain = op(PERMUTES, _inner_permute)


@rewrite_pattern("drop_identity_permute", _permute)
def drop_identity_permute(m):
    """A permute or transpose keeping every dim in place is its input."""
    order = permutation(m[_permute])
    return m[_x] if order == sorted(order) else None


@rewrite_pattern("collapse_permutes", _permute_chain)
def collapse_permutes(m):
    """permute(permute(x)) is one permute of x with the composed order (or x itself)."""
    first, second = permutation(m[_inner_permute]), permutation(m[_permute_chain])
    order = [first[k] for k in second]
    if order == sorted(order):
        return m[_x]
    permute = provided("permute")
    return None if permute is None else permute(m[_x], order)


SHAPE_PATTERNS = (drop_identity_reshape, collapse_reshapes, drop_identity_permute, collapse_permutes)
