"""Creation operators (no tensor inputs) against PyTorch."""
import re

import pytest
import torch

from kiln import ops
from kiln.graph import OperatorError
from tests.support import assert_close


@pytest.mark.parametrize("args, kwargs", [
    ((7,), {}), ((-3, 11, 4), {}), ((10, -2, -3), {}), ((5, 5), {}),
    ((0, 1, 0.3), {}), ((2.5,), {}), ((1, -2.25, -0.5), {}), ((0, 1, 0.1), {}),
    ((3, 20, 3), {"dtype": torch.float16}), ((-1.5, 2.5, 0.25), {"dtype": torch.bfloat16}),
    ((0, 1, 0.1), {"dtype": torch.float64}), ((-4, 9, 2), {"dtype": torch.int32}),
    ((0, 200, 7), {"dtype": torch.uint8}), ((4,), {"dtype": torch.float32, "device": "cpu"}),
    ((0.5, 5, 1.5), {"dtype": torch.int64}), ((-2.7, 4.9, 2.9), {"dtype": torch.int32}),
])
def test_arange(args, kwargs):
    out = ops.arange(*args, **kwargs)
    assert str(out.device) == "cpu"
    assert_close(out, torch.arange(*args, **kwargs))


@pytest.mark.parametrize("size, value, dtype", [
    ((2, 3), 1.5, None), ((4,), -7, None), ((3, 1, 2), True, None), ((), 2.25, None), ((0, 3), 1.0, None),
    ((2, 2), 3, torch.float16), ((5,), -0.75, torch.bfloat16), ((2, 3), 9, torch.int32),
    ((3,), 200, torch.uint8), ((2,), 1, torch.bool), ((2, 2), float("inf"), torch.float64),
])
def test_full(size, value, dtype):
    assert_close(ops.full(size, value, dtype=dtype, device="cpu"), torch.full(size, value, dtype=dtype))


@pytest.mark.parametrize("call, message", [
    (lambda: ops.arange(0, 5, 0), "arange: step 0 must be non-zero and lead from start 0 to end 5"),
    (lambda: ops.arange(5, 0, 1), "arange: step 1 must be non-zero and lead from start 5 to end 0"),
    (lambda: ops.arange(0, 5, dtype=torch.bool), "arange: bool results are not supported"),
    (lambda: ops.arange(0, "5"), "arange: end must be an int or a float, got '5'"),
    (lambda: ops.arange(3, dtype=torch.complex64), "arange: unsupported data type torch.complex64"),
    (lambda: ops.full((2, -1), 1.0), "full: size must be a sequence of non-negative ints"),
    (lambda: ops.full(3, 1.0), "full: size must be a sequence of non-negative ints"),
    (lambda: ops.full((2,), "a"), "full: fill_value must be a Python number"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_bad_input_names_the_operator(call, message):
    with pytest.raises(OperatorError, match=re.escape(message)):
        call()
