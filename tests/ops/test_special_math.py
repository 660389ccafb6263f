"""The operators of kiln_ops_builtin.special against PyTorch."""
import math

import pytest
import torch

import kiln
from kiln.graph import OperatorError
from tests.support import assert_close, rand

FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]

# name: (torch function, input domain (low, high), whether integers are taken (to float32))
UNARY = {
    "asin": (torch.asin, (-0.99, 0.99), False),
    "acos": (torch.acos, (-0.99, 0.99), False),
    "atan": (torch.atan, (-4, 4), True),
    "sinh": (torch.sinh, (-4, 4), True),
    "cosh": (torch.cosh, (-4, 4), False),
    "asinh": (torch.asinh, (-4, 4), True),
    "acosh": (torch.acosh, (1, 6), True),
    "atanh": (torch.atanh, (-0.99, 0.99), False),
    "log10": (torch.log10, (0.1, 50), True),
    "exp2": (torch.exp2, (-20, 20), True),
    "erfc": (torch.erfc, (-4, 9), True),
    "erfinv": (torch.erfinv, (-0.999, 0.999), False),
    "lgamma": (torch.lgamma, (-6.5, 30), True),
    "digamma": (torch.digamma, (-6.5, 30), True),
    "logit": (torch.logit, (0.01, 0.99), False),
    "frac": (torch.frac, (-9, 9), False),
}
CASES = [(name, dtype) for name in UNARY for dtype in FLOATS + ([torch.int32] if UNARY[name][2] else [])]


def _tolerance(name, dtype):
    """erfc's fit is good to ~1.2e-7 relative, so float64 results are compared at 1e-6."""
    return (1e-9, 1e-6) if name == "erfc" and dtype == torch.float64 else (None, None)


@pytest.mark.parametrize("name, dtype", CASES, ids=[f"{n}-{str(d)[6:]}" for n, d in CASES])
def test_unary(name, dtype):
    fn, (low, high), _ = UNARY[name]
    x = rand((7, 5), torch.float64, low=low, high=high).to(dtype).t()  # odd, non-contiguous
    atol, rtol = _tolerance(name, dtype)
    expected = fn(x)
    if name == "lgamma" and dtype == torch.float64:
        atol = 1e-12  # near the zeros of lgamma (x = 1, 2) relative error is meaningless
    assert_close(getattr(kiln.ops, name)(x), expected, atol, rtol)


@pytest.mark.parametrize("name", ["lgamma", "digamma", "erfinv", "erfc", "logit"])
def test_unary_edges(name):
    """Poles, infinities and the ends of the domain, as PyTorch gives them."""
    values = {"lgamma": [0.0, -1.0, -2.0, 1.0, 2.0, math.inf, -math.inf, -2.5],
              "digamma": [0.0, -1.0, -3.0, 1.0, 0.5, -0.5, math.inf],
              "erfinv": [-1.0, 1.0, 0.0, 1.5, -2.0],
              "erfc": [-math.inf, math.inf, 0.0, 12.0, -12.0, 27.0],
              "logit": [0.0, 1.0, 0.5, -0.5, 2.0]}[name]
    x = torch.tensor(values, dtype=torch.float64)
    assert_close(getattr(kiln.ops, name)(x), getattr(torch, name)(x), atol=1e-12, rtol=1e-9)


def test_logit_eps():
    x = rand((6, 3), low=-0.2, high=1.2)
    assert_close(kiln.ops.logit(x, eps=1e-3), torch.logit(x, eps=1e-3))


BINARY = {"hypot": torch.hypot, "copysign": torch.copysign, "fmax": torch.fmax, "fmin": torch.fmin,
          "logaddexp": torch.logaddexp, "logaddexp2": torch.logaddexp2}


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("name", list(BINARY))
def test_binary_broadcast(name, dtype):
    a = rand((4, 1, 5), dtype, low=-30, high=30)
    b = rand((3, 1), dtype, low=-30, high=30)
    assert_close(getattr(kiln.ops, name)(a, b), BINARY[name](a, b))


@pytest.mark.parametrize("name", list(BINARY))
def test_binary_special_values(name):
    """NaN, infinities and signed zeros."""
    values = torch.tensor([math.nan, math.inf, -math.inf, 0.0, -0.0, 1.5, -2.0])
    a, b = values[:, None].expand(7, 7), values[None, :].expand(7, 7)
    assert_close(getattr(kiln.ops, name)(a, b), BINARY[name](a, b))


def test_copysign_and_fmax_of_integers():
    a, b = rand((5, 4), torch.int32), rand((5, 4), torch.int64)
    assert_close(kiln.ops.copysign(a, b), torch.copysign(a, b))
    assert_close(kiln.ops.fmax(a, b), torch.fmax(a, b))
    assert_close(kiln.ops.fmin(a, 2), torch.fmin(a, torch.tensor(2)))


@pytest.mark.parametrize("dtype", FLOATS + [torch.int32])
def test_nan_to_num(dtype):
    x = rand((4, 6), dtype)
    if dtype.is_floating_point:
        x[0, 0], x[1, 2], x[3, 5] = math.nan, math.inf, -math.inf
    assert_close(kiln.ops.nan_to_num(x), torch.nan_to_num(x))
    assert_close(kiln.ops.nan_to_num(x, nan=1.5, posinf=9.0, neginf=-9.0),
                 torch.nan_to_num(x, nan=1.5, posinf=9.0, neginf=-9.0))


def test_errors_name_the_operator():
    with pytest.raises(OperatorError, match="hypot: unsupported dtype int64"):
        kiln.ops.hypot(rand((3,), torch.int64), rand((3,), torch.int64))
    with pytest.raises(OperatorError, match="frac: unsupported dtype"):
        kiln.ops.frac(rand((3,), torch.int32))
    with pytest.raises(OperatorError, match="nan_to_num: nan must be a number"):
        kiln.ops.nan_to_num(rand((3,)), nan="x")
