"""Creation operators: tensors made from scalars alone. Having no tensor input, they take the
output `device` as an attribute (default: the CPU)."""
from __future__ import annotations

import math

from kiln import dtypes
from kiln.graph import OperatorError, operator
from kiln.ir import cast, compute


def _number(op: str, name: str, value) -> int | float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise OperatorError(f"{op}: {name} must be an int or a float, got {value!r}")
    return value


def _dtype(op: str, dtype):
    try:
        return dtypes.data_type(dtype)
    except TypeError as exc:
        raise OperatorError(f"{op}: {exc}") from None


@operator("arange")
def arange(start, end=None, step=1, dtype=None, device=None):
    """start, start + step, ... up to `end` (excluded); arange(n) counts from 0 to n - 1.

    Without `dtype` the result is int64 when every bound is an int, else float32; a range has
    ceil((end - start) / step) elements, its bounds first truncated to ints for an integer
    dtype, as in PyTorch.
    """
    if end is None:
        start, end = 0, start
    start, end, step = (_number("arange", n, v) for n, v in (("start", start), ("end", end), ("step", step)))
    exact = all(isinstance(v, int) for v in (start, end, step))
    t = _dtype("arange", dtype if dtype is not None else (dtypes.int64 if exact else dtypes.float32))
    if t.is_bool:
        raise OperatorError("arange: bool results are not supported; use an integer or float dtype")
    if t.is_integer:  # PyTorch truncates the bounds to integers first (symbolic sizes stay)
        start, end, step = (v if isinstance(v, int) else int(v) for v in (start, end, step))
        exact = True
    if step == 0 or (end - start) * step < 0:
        raise OperatorError(f"arange: step {step} must be non-zero and lead from start {start} "
                            f"to end {end}")
    length = -((start - end) // step) if exact else math.ceil((end - start) / step)
    if exact:
        return compute((length,), lambda i: cast(i * step + start, t))
    return compute((length,), lambda i: cast(cast(i, dtypes.float64) * step + start, t))


@operator("full")
def full(size, fill_value, dtype=None, device=None):
    """A tensor of shape `size` filled with `fill_value` (its dtype, without `dtype`, is bool,
    int64 or float32 after the Python type of the value, as in PyTorch)."""
    if not isinstance(size, (list, tuple)) or not all(isinstance(s, int) and s >= 0 for s in size):
        raise OperatorError(f"full: size must be a sequence of non-negative ints, got {size!r}")
    if not isinstance(fill_value, (bool, int, float)):
        raise OperatorError(f"full: fill_value must be a Python number, got {fill_value!r}")
    t = _dtype("full", dtype if dtype is not None else dtypes.scalar_type(fill_value))
    return compute(size, lambda *i: cast(fill_value, t))
