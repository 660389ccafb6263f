"""Matrix multiplication."""
from kiln.graph import OperatorError, operator
from kiln.ir import compute, reduce


@operator("matmul")
def matmul(x, y):
    if x.ndim != 2 or y.ndim != 2 or x.shape[1] != y.shape[0]:
        raise OperatorError(f"matmul: cannot multiply {x.shape} by {y.shape}")
    acc = "float32" if x.dtype.is_16bit_float else x.dtype
    return compute((x.shape[0], y.shape[1]),
                   lambda i, j: reduce([x.shape[1]], lambda k: x[i, k] * y[k, j], dtype=acc), dtype=x.dtype)
