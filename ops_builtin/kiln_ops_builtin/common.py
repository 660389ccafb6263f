"""Shared helpers of operator definitions: broadcasting and type promotion."""
from kiln import dtypes
from kiln.graph import OperatorError
from kiln.ir import TensorNode, cast, compute


def broadcast_shape(op: str, *shapes) -> tuple[int, ...]:
    """The broadcast of several shapes, as NumPy and PyTorch define it."""
    rank = max(len(s) for s in shapes)
    out = []
    for k in range(rank):
        dims = {s[k - rank + len(s)] for s in shapes if k - rank + len(s) >= 0} - {1}
        if len(dims) > 1:
            raise OperatorError(f"{op}: shapes {' and '.join(str(tuple(s)) for s in shapes)} "
                                "cannot be broadcast together")
        out.append(dims.pop() if dims else 1)
    return tuple(out)


def broadcast_load(t: TensorNode, index, shape):
    """Element of `t` at `index` of the broadcast `shape`."""
    offset = len(shape) - len(t.shape)
    return t[[0 if t.shape[k] == 1 else index[k + offset] for k in range(len(t.shape))]]


def result_type(*operands) -> dtypes.DataType:
    """PyTorch's result type of tensors and Python scalars combined."""
    tensors = [o.dtype for o in operands if isinstance(o, TensorNode)]
    t = dtypes.promote(*tensors)
    for o in operands:
        if not isinstance(o, TensorNode):
            t = dtypes.promote_with_scalar(t, o)
    return t


def binary_compute(op: str, x, y, fn, dtype=None):
    """A broadcasting element-wise compute of `fn(x, y)` after type promotion."""
    if not isinstance(x, TensorNode) and not isinstance(y, TensorNode):
        raise OperatorError(f"{op}: at least one operand must be a tensor")
    t = result_type(x, y)
    shapes = [o.shape for o in (x, y) if isinstance(o, TensorNode)]
    shape = broadcast_shape(op, *shapes)

    def value(o, i):
        return cast(broadcast_load(o, i, shape), t) if isinstance(o, TensorNode) else cast(o, t)

    return compute(shape, lambda *i: fn(value(x, i), value(y, i)), dtype=dtype)
