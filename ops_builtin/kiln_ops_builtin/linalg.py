"""Matrix products: matmul (with torch.matmul's 1-D and batched broadcasting rules), linear, and
the grouped product of mixture-of-experts layers (each row by the matrix of its group).

Float32/float64 and integers accumulate in their own type; float16/bfloat16 accumulate in
float32 and round once to their type. `allow_tf32` lets a GPU template round float32 operands
to TF32 on tensor cores (as `torch.backends.cuda.matmul.allow_tf32` lets cuBLAS); it does not
change the definition, which the CPU computes in float32.
"""
import operator as python

from kiln import dtypes
from kiln.graph import TF32, OperatorError, Traits, operator
from kiln.ir import cast, compute, minimum, reduce, select

from kiln_ops_builtin.common import accumulator_type, broadcast_load, broadcast_shape, check_dtype
from kiln_ops_builtin.indexing import INDEX_TYPES

DTYPES = dtypes.FLOATS + dtypes.INTEGERS


def _check_operands(op: str, *tensors) -> None:
    for t in tensors:
        check_dtype(op, t, DTYPES, "a floating-point or integer type")
        if t.ndim == 0:
            raise OperatorError(f"{op}: input '{t.name}' is 0-dimensional; expected at least 1 dimension")
    if len({t.dtype for t in tensors}) > 1:
        raise OperatorError(f"{op}: expected inputs of one dtype, got "
                            f"{', '.join(str(t.dtype) for t in tensors)}")


@operator("matmul", traits=Traits(tf32=TF32.MATMUL, implements=python.matmul))
def matmul(x, y, allow_tf32=False):
    """torch.matmul: dot product (1-D x 1-D), matrix-vector, vector-matrix, and matrix
    products with the batch dimensions broadcast (`allow_tf32`: see the module doc)."""
    _check_operands("matmul", x, y)
    k = x.shape[-1]
    ky = y.shape[0] if y.ndim == 1 else y.shape[-2]
    if k != ky:
        raise OperatorError(f"matmul: cannot multiply shapes {x.shape} and {y.shape} "
                            f"(inner dimensions {k} and {ky} differ)")
    batch = broadcast_shape("matmul", x.shape[:-2], y.shape[:-2])
    rows = x.shape[-2:-1] if x.ndim > 1 else ()
    cols = y.shape[-1:] if y.ndim > 1 else ()
    nb, nr = len(batch), len(rows)
    x_shape, y_shape = batch + rows + (k,), batch + (k,) + cols
    acc = accumulator_type(x.dtype)

    def element(*idx):
        b, i, j = idx[:nb], idx[nb:nb + nr], idx[nb + nr:]
        return reduce([k], lambda r: cast(broadcast_load(x, b + i + (r,), x_shape), acc)
                      * cast(broadcast_load(y, b + (r,) + j, y_shape), acc), dtype=acc)

    return compute(batch + rows + cols, element, dtype=x.dtype)


@operator("linear", traits=Traits(tf32=TF32.MATMUL))
def linear(x, weight, bias=None, allow_tf32=False):
    """torch.nn.functional.linear: x @ weight^T + bias, for x of shape (..., in_features),
    weight of shape (out_features, in_features) and bias of shape (out_features,)
    (`allow_tf32`: see the module doc)."""
    tensors = (x, weight) if bias is None else (x, weight, bias)
    _check_operands("linear", *tensors)
    if weight.ndim != 2:
        raise OperatorError("linear: weight must be 2-D (out_features, in_features), "
                            f"got shape {weight.shape}")
    out_features, in_features = weight.shape
    if x.shape[-1] != in_features:
        raise OperatorError(f"linear: input of shape {x.shape} does not end with in_features = "
                            f"{in_features} of weight {weight.shape}")
    if bias is not None and bias.shape != (out_features,):
        raise OperatorError(f"linear: bias of shape {bias.shape} does not match "
                            f"out_features = {out_features}")
    acc = accumulator_type(x.dtype)

    def element(*idx):
        lead, o = idx[:-1], idx[-1]
        total = reduce([in_features], lambda r: cast(x[lead + (r,)], acc) * cast(weight[o, r], acc),
                       dtype=acc)
        return total if bias is None else total + cast(bias[o], acc)

    return compute(x.shape[:-1] + (out_features,), element, dtype=x.dtype)


@operator("dft")
def dft(x, basis):
    """x @ basis for `x` (..., K) and a 2-D `basis` (K, N) of x's dtype, always in that dtype:
    a discrete Fourier transform as the product with its basis matrix (kiln-mappings-builtin's
    FFT rules build it). A matmul without the trait `tf32`: PyTorch's FFTs never round to TF32,
    so neither does this product, whatever `torch.backends.cuda.matmul.allow_tf32` says; the
    matmul templates take it all the same."""
    _check_operands("dft", x, basis)
    if basis.ndim != 2 or x.shape[-1] != basis.shape[0]:
        raise OperatorError(f"dft: expected x (..., K) and a basis (K, N), got {x.shape} and {basis.shape}")
    (k, n), acc = basis.shape, accumulator_type(x.dtype)

    def element(*idx):
        lead, j = idx[:-1], idx[-1]
        return reduce([k], lambda r: cast(x[lead + (r,)], acc) * cast(basis[r, j], acc), dtype=acc)

    return compute(x.shape[:-1] + (n,), element, dtype=x.dtype)


@operator("grouped_matmul")
def grouped_matmul(x, weight, group):
    """Each row of `x` (S, K) times the (K, N) matrix of its group in `weight` (G, K, N):
    out[s] = x[s] @ weight[group[s]] for `group` (S,) in [0, G), and zeros where group[s] is G
    or more (a row in no group). The grouped GEMM of mixture-of-experts layers, read in place:
    no (S, K, N) gather of the weights."""
    _check_operands("grouped_matmul", x, weight)
    if x.ndim != 2 or weight.ndim != 3 or group.shape != (x.shape[0],) or group.dtype not in INDEX_TYPES:
        raise OperatorError(f"grouped_matmul: expected x (S, K), weight (G, K, N) and int group (S,), got "
                            f"{x.shape}, {weight.shape} and {group.dtype} {group.shape}")
    (rows, k), (groups, k_weight, n) = x.shape, weight.shape
    if k != k_weight:
        raise OperatorError(f"grouped_matmul: cannot multiply rows of {k} by matrices {weight.shape}")
    if groups == 0:     # no matrix to read: every row is in no group
        return compute((rows, n), lambda s, j: cast(0, x.dtype), dtype=x.dtype)
    acc = accumulator_type(x.dtype)

    def element(s, j):
        g = cast(group[s], dtypes.int64)
        at = minimum(g, groups - 1)
        total = reduce([k], lambda r: cast(x[s, r], acc) * cast(weight[at, r, j], acc), dtype=acc)
        return select(g < groups, total, cast(0, acc))

    return compute((rows, n), element, dtype=x.dtype)
