"""`matmul(x, transpose(W)) + b`, the shape a linear layer takes in exported graphs, as one
`linear(x, W, b)` where a plugin provides `linear` (a single template-scheduled operator
with its bias)."""
from kiln.passes.pattern import op, rewrite_pattern, wildcard
from kiln.passes.provided import provided

from kiln_ops_builtin.patterns.shape_chains import PERMUTES, permutation

_x, _w, _b = wildcard(), wildcard(), wildcard()
_wt = op(PERMUTES, _w, where=lambda n: n.inputs[0].ndim == 2 and permutation(n) == [1, 0])
_matmul = op("matmul", _x, _wt)
_source = op("add", _matmul, _b, commutative=True, where=lambda n: n.attrs.get("alpha", 1) == 1)


@rewrite_pattern("matmul_bias", _source)
def matmul_bias(m):
    """matmul by a transposed 2-D weight plus a bias over the last dim: one linear."""
    linear = provided("linear")
    x, w, b = m[_x], m[_w], m[_b]
    out = m[_source].outputs[0]
    if (linear is None or x.ndim < 2 or b.shape != (w.shape[0],)
            or len({x.dtype, w.dtype, b.dtype, out.dtype}) != 1 or out.shape != m[_matmul].outputs[0].shape):
        return None
    return linear(x, w, b)
