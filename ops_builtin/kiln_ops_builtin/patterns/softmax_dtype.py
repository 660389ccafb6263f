"""A softmax asked to compute in float32 and cast back is a plain softmax.

`softmax(x, dim, dtype=float32).to(x.dtype)` (Hugging Face's eager attention) and
`softmax(x, dim, dtype=x.dtype)` are `softmax(x, dim)`: a softmax of a 16-bit tensor computes in
float32 and rounds its result once, as PyTorch's does, so the two give the same values; the
plain form is what the attention patterns match.
"""
from kiln import dtypes
from kiln.passes.pattern import op, rewrite_pattern, wildcard
from kiln.passes.provided import provided

_x = wildcard()
_softmax = op("softmax", _x, where=lambda n: n.attrs.get("dtype") is not None)
_cast_back = op("cast", _softmax)
FLOAT32_SOFTMAX = (dtypes.float16, dtypes.bfloat16, dtypes.float32)


def _plain(m, node):
    softmax = provided("softmax")
    return None if softmax is None else softmax(m[_x], node.attrs["dim"])


@rewrite_pattern("softmax_cast_back", _cast_back)
def softmax_cast_back(m):
    """softmax(x, dtype=float32).to(x.dtype) for x of 16 or 32 bits is softmax(x)."""
    node, out = m[_softmax], m[_cast_back].outputs[0]
    if (dtypes.data_type(node.attrs["dtype"]) != dtypes.float32 or out.dtype != m[_x].dtype
            or m[_x].dtype not in FLOAT32_SOFTMAX):
        return None
    return _plain(m, node)


@rewrite_pattern("softmax_own_dtype", _softmax)
def softmax_own_dtype(m):
    """softmax(x, dtype=x.dtype) is softmax(x)."""
    node = m[_softmax]
    return _plain(m, node) if dtypes.data_type(node.attrs["dtype"]) == m[_x].dtype else None


SOFTMAX_DTYPE_PATTERNS = (softmax_cast_back, softmax_own_dtype)
