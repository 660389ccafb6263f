"""Unary element-wise math, where, clamp and cast against PyTorch."""
import pytest
import torch

import kiln
from kiln.graph import OperatorError
from tests.support import assert_close, rand

FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INTS = [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8]
NUMERIC = FLOATS + INTS
ALL = NUMERIC + [torch.bool]

# name (of the Kiln operator and of the torch function): (dtypes, domain (low, high) of the inputs)
UNARY = {
    "abs": (NUMERIC, (-3, 3)),
    "neg": (NUMERIC, (-3, 3)),
    "sign": (ALL, (-3, 3)),
    "floor": (NUMERIC, (-3, 3)),
    "ceil": (NUMERIC, (-3, 3)),
    "trunc": (NUMERIC, (-3, 3)),
    "round": (NUMERIC, (-3, 3)),
    "exp": (ALL, (-3, 3)),
    "expm1": (ALL, (-3, 3)),
    "log": (ALL, (1, 5)),
    "log1p": (ALL, (0, 5)),
    "log2": (ALL, (1, 5)),
    "sqrt": (ALL, (1, 5)),
    "rsqrt": (ALL, (1, 5)),
    "sin": (ALL, (-3, 3)),
    "cos": (ALL, (-3, 3)),
    "tan": (ALL, (-1, 1)),
    "tanh": (ALL, (-3, 3)),
    "erf": (ALL, (-3, 3)),
    "sigmoid": (ALL, (-3, 3)),
    "reciprocal": (ALL, (1, 3)),
    "logical_not": (ALL, (-3, 3)),
    "bitwise_not": (INTS + [torch.bool], (-3, 3)),
}
CASES = [(name, dtype) for name, (dtypes, _) in UNARY.items() for dtype in dtypes]


def _input(name, shape, dtype):
    low, high = UNARY[name][1]
    if dtype.is_floating_point and low >= 0:
        low += 0.1  # log(0), rsqrt(0) are infinite: stay inside the domain
    return rand(shape, dtype, low=low, high=high)


@pytest.mark.parametrize("name, dtype", CASES, ids=[f"{n}-{str(d)[6:]}" for n, d in CASES])
def test_unary_dtypes(name, dtype):
    x = _input(name, (5, 4), dtype).t()  # non-contiguous
    assert_close(getattr(kiln.ops, name)(x), getattr(torch, name)(x))


# Each operator once more, in one of these shapes (0-d, 1-d, 3-d) in turn.
SHAPE_CASES = [(name, [(), (7,), (2, 3, 4)][k % 3]) for k, name in enumerate(UNARY)]


@pytest.mark.parametrize("name, shape", SHAPE_CASES)
def test_unary_shapes(name, shape):
    x = _input(name, shape, torch.int32 if name == "bitwise_not" else torch.float32)
    assert_close(getattr(kiln.ops, name)(x), getattr(torch, name)(x))


def test_round_half_to_even():
    x = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 0.49, 3.51])
    assert_close(kiln.ops.round(x), torch.round(x))


@pytest.mark.parametrize("decimals", [2, -1])
@pytest.mark.parametrize("dtype", FLOATS)
def test_round_decimals(dtype, decimals):
    x = rand((3, 5), dtype, low=-300, high=300)
    assert_close(kiln.ops.round(x, decimals=decimals), torch.round(x, decimals=decimals))


@pytest.mark.parametrize("name", ["isnan", "isinf", "isfinite"])
@pytest.mark.parametrize("dtype", ALL)
def test_special_values(name, dtype):
    x = rand((3, 4), dtype)
    if dtype.is_floating_point:
        x[0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    assert_close(getattr(kiln.ops, name)(x.t()), getattr(torch, name)(x.t()))


@pytest.mark.parametrize("name", ["sign", "floor", "round", "exp", "sigmoid", "rsqrt"])
def test_unary_of_nan_inf_and_zero(name):
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 2.5])
    assert_close(getattr(kiln.ops, name)(x), getattr(torch, name)(x))


@pytest.mark.parametrize("name, x", [
    ("abs", rand((3,), torch.bool)),
    ("neg", rand((3,), torch.bool)),
    ("floor", rand((3,), torch.bool)),
    ("bitwise_not", rand((3,), torch.float32)),
])
def test_unary_unsupported_dtype(name, x):
    with pytest.raises(OperatorError, match=f"^{name}: unsupported dtype {str(x.dtype)[6:]}"):
        getattr(kiln.ops, name)(x)


def test_round_errors():
    with pytest.raises(OperatorError, match="round: decimals=1 needs a floating-point input"):
        kiln.ops.round(rand((3,), torch.int32), decimals=1)
    with pytest.raises(OperatorError, match="round: decimals must be an int"):
        kiln.ops.round(rand((3,)), decimals=1.5)


# ---------------------------------------------------------------- where

@pytest.mark.parametrize("dtype", ALL)
def test_where_dtypes(dtype):
    cond = rand((5, 4), torch.bool).t()
    x, y = rand((5,), dtype), rand((4, 1), dtype)
    assert_close(kiln.ops.where(cond, x, y), torch.where(cond, x, y))


@pytest.mark.parametrize("x, y", [
    (rand((3, 4)), 0.5),
    (2, rand((4,), torch.int8)),
    (1.0, 2),
    (rand((3, 1), torch.int32), rand((4,), torch.float16)),
    (rand((), torch.float64), rand((3, 4), torch.int16)),
], ids=["scalar-other", "scalar-input", "two-scalars", "promote", "zero-dim"])
def test_where_operands(x, y):
    cond = rand((3, 4), torch.bool)
    assert_close(kiln.ops.where(cond, x, y), torch.where(cond, x, y))


def test_where_errors():
    x = rand((3, 4))
    with pytest.raises(OperatorError, match="where: unsupported dtype int64 of input 'condition'"):
        kiln.ops.where(rand((3, 4), torch.int64), x, x)
    with pytest.raises(OperatorError, match="where: condition must be a bool tensor"):
        kiln.ops.where(True, x, x)
    with pytest.raises(OperatorError, match=r"where: shapes .* cannot be broadcast"):
        kiln.ops.where(rand((3, 4), torch.bool), x, rand((3,)))


# ---------------------------------------------------------------- clamp

@pytest.mark.parametrize("dtype", NUMERIC)
def test_clamp_dtypes(dtype):
    x = rand((5, 4), dtype).t()
    low, high = (-1, 2) if dtype in INTS else (-0.5, 1.25)
    if dtype == torch.uint8:
        low = 1
    assert_close(kiln.ops.clamp(x, low, high), torch.clamp(x, low, high))


@pytest.mark.parametrize("x, low, high", [
    (rand((3, 4)), rand((4,), low=-1, high=0), rand((3, 1), low=0, high=1)),
    (rand((3, 4)), -0.5, None),
    (rand((3, 4)), None, rand(())),
    (rand((3, 4)), 1.0, -1.0),                      # min > max gives max
    (rand((3, 4), torch.int32), 0.5, None),          # a float bound makes the result float32
    (rand((3, 4), torch.float16), rand((4,), torch.float64), None),
], ids=["tensor-bounds", "min-only", "max-only", "min-above-max", "int-float-bound", "promote"])
def test_clamp_bounds(x, low, high):
    assert_close(kiln.ops.clamp(x, low, high), torch.clamp(x, low, high))


def test_clamp_keeps_nan():
    x = torch.tensor([float("nan"), -2.0, 0.3, 2.0])
    assert_close(kiln.ops.clamp(x, -1, 1), torch.clamp(x, -1, 1))


def test_clamp_errors():
    with pytest.raises(OperatorError, match="clamp: at least one of 'min' and 'max'"):
        kiln.ops.clamp(rand((3,)))
    with pytest.raises(OperatorError, match="clamp: unsupported dtype bool"):
        kiln.ops.clamp(rand((3,), torch.bool), min=False)


# ---------------------------------------------------------------- cast

# Every conversion path: to wide, 16-bit and narrow types, signed, unsigned and bool.
CAST_TARGETS = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int8, torch.uint8,
                torch.bool]
CAST_CASES = [(src, dst) for src in ALL for dst in CAST_TARGETS if src != dst]


@pytest.mark.parametrize("src, dst", CAST_CASES, ids=[f"{str(s)[6:]}-{str(d)[6:]}" for s, d in CAST_CASES])
def test_cast(src, dst):
    # Floats convert to integers only from values in range (otherwise undefined in C++).
    x = rand((5, 4), src, low=0 if dst == torch.uint8 else -100, high=100).t()
    assert_close(kiln.ops.cast(x, dst), x.to(dst))


def test_cast_dtype_names():
    x = rand((3, 4))
    assert_close(kiln.ops.cast(x, "float16"), x.half())
    assert_close(kiln.ops.cast(x, kiln.dtypes.int64), x.long())
    with pytest.raises(OperatorError, match="cast: unsupported data type 'complex64'"):
        kiln.ops.cast(x, "complex64")
