"""Shared helpers of operator definitions: broadcasting and type promotion."""
from kiln import dtypes
from kiln.graph import OperatorError
from kiln.ir import TensorNode, cast, compute, exp, exp_approx, maximum, minimum, reciprocal_approx
from kiln.ir.size import distinct


def broadcast_shape(op: str, *shapes) -> tuple[int, ...]:
    """The broadcast of several shapes, as NumPy and PyTorch define it."""
    rank = max(len(s) for s in shapes)
    out = []
    for k in range(rank):
        dims = [d for d in distinct(s[k - rank + len(s)] for s in shapes if k - rank + len(s) >= 0) if d != 1]
        if len(dims) > 1:
            raise OperatorError(f"{op}: shapes {' and '.join(str(tuple(s)) for s in shapes)} "
                                "cannot be broadcast together")
        out.append(dims.pop() if dims else 1)
    return tuple(out)


def broadcast_load(t: TensorNode, index, shape):
    """Element of `t` at `index` of the broadcast `shape`."""
    offset = len(shape) - len(t.shape)
    return t[[0 if t.shape[k] == 1 else index[k + offset] for k in range(len(t.shape))]]


# Dtype sets an operator accepts: (what they are called in errors, the types).
ANY = ("any", dtypes.ALL)
FLOATING = ("floating-point", dtypes.FLOATS)
NUMERIC = ("numeric", dtypes.FLOATS + dtypes.INTEGERS)
INTEGER = ("integer", dtypes.INTEGERS)
INTEGRAL = ("integer or bool", dtypes.INTEGERS + (dtypes.boolean,))


def result_type(*operands, op: str = "result_type") -> dtypes.DataType:
    """PyTorch's result type of tensors and Python scalars combined.

    Tensors with dimensions outrank 0-d tensors, which outrank Python scalars (bool, int64,
    float32), except that a lower rank still lifts the category (bool < integer < float).
    Errors name the operator `op`.
    """
    for o in operands:
        if not isinstance(o, (TensorNode, bool, int, float)):
            raise OperatorError(f"{op}: operand {o!r} is neither a tensor nor a Python scalar")
    ranks = ([dtypes.scalar_type(o) for o in operands if not isinstance(o, TensorNode)],
             [o.dtype for o in operands if isinstance(o, TensorNode) and not o.shape],
             [o.dtype for o in operands if isinstance(o, TensorNode) and o.shape])
    result = None
    for types in ranks:
        if types:
            higher = dtypes.promote(*types)
            if result is None or higher.is_float:
                result = higher
            elif higher.is_bool or result.is_float:
                result = dtypes.promote(higher, result)
            else:
                result = higher
    if result is None:
        raise OperatorError(f"{op}: no operands")
    return result


def operand_value(o, index, shape, dtype, compute_type=None):
    """Element `index` of the broadcast `shape` of tensor `o` (or the Python scalar `o`) as a
    value of `dtype`, then handed over in `compute_type` (by default `dtype`)."""
    value = cast(broadcast_load(o, index, shape) if isinstance(o, TensorNode) else o, dtype)
    return cast(value, compute_type or dtype)


def elementwise_compute(op: str, operands, fn, accepts=ANY, to_float: bool = False, dtype=None,
                        exact_scalars: bool = False):
    """A broadcasting element-wise compute of `fn(*values)` over tensors and Python scalars.

    The operands promote to their result type t (`to_float`: integers and bool then go to
    float32), which must be one of the dtype set `accepts`. `fn` gets the values in t's
    arithmetic type (float32 for 16-bit floats, as PyTorch computes them); the value it returns
    converts to `dtype`, by default t. A Python scalar is rounded to t first, except with
    `exact_scalars` where t is a 16-bit float: then it enters in the arithmetic type, unrounded,
    as PyTorch's CUDA kernels take the scalar of `x * 0.7978845608` (GELU's tanh form would
    otherwise scale by bfloat16's 0.796875, a bias of 0.13%).
    """
    tensors = [o for o in operands if isinstance(o, TensorNode)]
    if not tensors:
        raise OperatorError(f"{op}: at least one operand must be a tensor")
    t = result_type(*operands, op=op)
    if t not in accepts[1]:
        given = ", ".join(str(o.dtype if isinstance(o, TensorNode) else type(o).__name__) for o in operands)
        raise OperatorError(f"{op}: unsupported dtype {t} (operands: {given}); expected {accepts[0]} "
                            f"dtypes ({', '.join(map(str, accepts[1]))})")
    if to_float and not t.is_float:
        t = dtypes.float32
    ct = accumulator_type(t)
    shape = broadcast_shape(op, *[o.shape for o in tensors])
    exact = exact_scalars and t in dtypes.HALF_FLOATS

    def value(o, i):
        if exact and not isinstance(o, (TensorNode, bool)):
            return cast(o, ct)
        return operand_value(o, i, shape, t, ct)
    return compute(shape, lambda *i: fn(*[value(o, i) for o in operands]), dtype=dtype or t)


def normalize_dim(op: str, dim: int, ndim: int) -> int:
    """`dim` counted from 0, accepting negative dims as PyTorch does (a 0-d tensor takes 0 and -1)."""
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise OperatorError(f"{op}: dim must be an int, got {dim!r}")
    rank = max(ndim, 1)
    if not -rank <= dim < rank:
        raise OperatorError(f"{op}: dim {dim} is out of range for a tensor of rank {ndim} "
                            f"(expected {-rank} to {rank - 1})")
    return dim % rank


def ravel(index, shape):
    """The row-major flat position of `index` in `shape`."""
    flat = 0
    for i, s in zip(index, shape):
        flat = flat * s + i
    return flat


def clamp_index(i, size: int):
    """Index expression `i` (any integer type) clamped into [0, size), for indices Kiln computes
    itself and knows to be in range (user indices go through `indexing.checked_index`, which
    reports out-of-range ones): generated code never reads out of bounds."""
    return minimum(maximum(cast(i, dtypes.int64), 0), size - 1)


def accumulator_type(dtype: dtypes.DataType) -> dtypes.DataType:
    """The type a sum of `dtype` values accumulates in, and arithmetic on them runs in (PyTorch's
    opmath type): float32 for 16-bit floats."""
    return dtypes.float32 if dtype.is_16bit_float else dtype


def logistic(v, result: dtypes.DataType, scale=1):
    """scale / (1 + e ** -v) of float32 values, for an operator whose result is `result`: where
    that is a 16-bit float, the value is rounded to it, so the IR's approximate exponential and
    reciprocal (errors under 2^-16 relative) serve."""
    if result.is_16bit_float:
        fraction = reciprocal_approx(1 + exp_approx(-v))
        return fraction if isinstance(scale, int) and scale == 1 else scale * fraction
    return scale / (1 + exp(-v))


def check_dtype(op: str, t: TensorNode, allowed, what: str = "floating-point") -> None:
    """Raise an OperatorError unless `t`'s dtype is one of `allowed`."""
    if t.dtype not in allowed:
        raise OperatorError(f"{op}: unsupported dtype {t.dtype} of input '{t.name}'; "
                            f"expected {what} ({', '.join(map(str, allowed))})")


def int_tuple(op: str, name: str, value, n: int) -> tuple[int, ...]:
    """A per-dimension parameter (an int, or a sequence of `n` ints) as a tuple of `n` ints."""
    values = (value,) * n if isinstance(value, int) else tuple(value)
    if len(values) == 1:
        values *= n
    if len(values) != n or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise OperatorError(f"{op}: '{name}' must be an int or {n} ints, got {value!r}")
    return values


def check_spatial_input(op: str, x: TensorNode, nd: int) -> None:
    """Raise unless `x` is (N, C, *spatial) or unbatched (C, *spatial) with `nd` spatial dims."""
    if x.ndim not in (nd + 1, nd + 2):
        raise OperatorError(f"{op}: expected a {nd + 1}-D (unbatched) or {nd + 2}-D input, "
                            f"got shape {x.shape}")


def in_bounds(positions, sizes):
    """The condition that every index expression in `positions` lies in [0, size)."""
    cond = None
    for p, s in zip(positions, sizes):
        c = (p >= 0) & (p < s)
        cond = c if cond is None else cond & c
    return cond
