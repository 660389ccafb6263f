"""Activation functions against torch.nn.functional."""
import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.graph import OperatorError
from tests.support import assert_close, rand

FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INTS = [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8]

# case: (operator, also F.<operator>; keyword arguments; dtypes)
ACTIVATIONS = {
    "relu": ("relu", {}, FLOATS + INTS),
    "gelu": ("gelu", {}, FLOATS),
    "gelu_tanh": ("gelu", {"approximate": "tanh"}, FLOATS),
    "silu": ("silu", {}, FLOATS),
    "hardtanh": ("hardtanh", {"min_val": -0.5, "max_val": 2.0}, FLOATS + INTS),
    "relu6": ("relu6", {}, FLOATS + INTS),
    "hardsigmoid": ("hardsigmoid", {}, FLOATS),
    "hardswish": ("hardswish", {}, FLOATS),
    "leaky_relu": ("leaky_relu", {"negative_slope": 0.2}, FLOATS),
    "elu": ("elu", {"alpha": 0.7}, FLOATS),
    "selu": ("selu", {}, FLOATS),
    "celu": ("celu", {"alpha": 1.5}, FLOATS),
    "softplus": ("softplus", {"beta": 2.0, "threshold": 3.0}, FLOATS),
    "mish": ("mish", {}, FLOATS),
    "logsigmoid": ("logsigmoid", {}, FLOATS),
    "softsign": ("softsign", {}, FLOATS + INTS),
}
CASES = [(case, dtype) for case, (_, _, dtypes) in ACTIVATIONS.items() for dtype in dtypes]


def _check(case, x):
    name, kwargs, _ = ACTIVATIONS[case]
    assert_close(getattr(kiln.ops, name)(x, **kwargs), getattr(F, name)(x, **kwargs))


@pytest.mark.parametrize("case, dtype", CASES, ids=[f"{c}-{str(d)[6:]}" for c, d in CASES])
def test_activation_dtypes(case, dtype):
    _check(case, rand((6, 5), dtype, low=-8 if dtype != torch.uint8 else 0, high=8).t())


@pytest.mark.parametrize("shape", [(), (7,), (2, 3, 4)])
@pytest.mark.parametrize("case", list(ACTIVATIONS))
def test_activation_shapes(case, shape):
    _check(case, rand(shape, low=-4, high=4))


def test_gelu_default_is_exact():
    x = rand((3, 4))
    assert_close(kiln.ops.gelu(x, approximate="none"), F.gelu(x))


@pytest.mark.parametrize("name, x", [
    ("gelu", rand((3,), torch.int32)),
    ("silu", rand((3,), torch.int64)),
    ("mish", rand((3,), torch.bool)),
    ("relu", rand((3,), torch.bool)),
    ("hardtanh", rand((3,), torch.bool)),
])
def test_unsupported_dtype(name, x):
    with pytest.raises(OperatorError, match=f"^{name}: unsupported dtype {str(x.dtype)[6:]}"):
        getattr(kiln.ops, name)(x)


def test_bad_attributes():
    with pytest.raises(OperatorError, match="gelu: approximate must be 'none' or 'tanh'"):
        kiln.ops.gelu(rand((3,)), approximate="sigmoid")
    with pytest.raises(OperatorError, match="celu: alpha must not be 0"):
        kiln.ops.celu(rand((3,)), alpha=0.0)
