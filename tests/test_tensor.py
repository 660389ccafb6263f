"""The tensor API: creation, printing, conversion to and from torch and NumPy, Python operators."""
from __future__ import annotations

import operator

import numpy as np
import pytest
import torch

import kiln
from support import assert_close, rand


def test_print_shows_shape_dtype_device_and_values():
    a = kiln.asarray([[-0.131, 0.24, 0.23], [-1.3, 0.61, -0.54]])
    assert str(a) == ("Tensor(shape=(2, 3), dtype='float32', device='cpu')\n"
                      "[[-0.13  0.24  0.23]\n"
                      " [-1.3   0.61 -0.54]]")


def test_print_symbolic_tensor_and_its_trace():
    x = kiln.symbol([4], "float16")
    assert repr(x) == "Tensor(shape=(4,), dtype='float16', device='cpu')"
    y = kiln.ops.relu(x)
    head, trace = repr(y).splitlines()
    assert head == repr(x) and trace == "from (<Relu operator>, 0)"
    assert y.trace[0].outputs[0] is y and y.trace[1] == 0 and x.trace is None


@pytest.mark.parametrize("make, value", [(kiln.zeros, 0), (kiln.ones, 1), (lambda s, dtype: kiln.full(s, 7, dtype), 7)])
@pytest.mark.parametrize("dtype", ["float32", "int8", "bool", "bfloat16"])
def test_filled_tensors(make, value, dtype):
    t = make([2, 3], dtype=dtype)
    assert (t.shape, str(t.dtype), str(t.device)) == ((2, 3), dtype, "cpu")
    assert t.torch().dtype == kiln.data_type(dtype).torch_dtype
    assert torch.equal(t.torch(), torch.full((2, 3), value).to(t.torch().dtype))


def test_randn_and_empty():
    r = kiln.randn([300], dtype="float64", mean=5.0, stddev=0.5)
    assert r.dtype == kiln.dtypes.float64 and abs(r.numpy().mean() - 5.0) < 0.2
    assert 0.3 < r.numpy().std() < 0.7
    assert kiln.empty([0, 4], "int32").shape == (0, 4)
    with pytest.raises(TypeError, match="randn makes floating-point tensors, not int32"):
        kiln.randn([2], dtype="int32")


@pytest.mark.parametrize("data, dtype", [
    ([[1.5, 2.0], [3.0, 4.0]], torch.float32),
    ([1, 2, 3], torch.int64),
    ([True, False], torch.bool),
    (2.5, torch.float32),
])
def test_asarray_from_lists_and_scalars(data, dtype):
    t = kiln.asarray(data)
    assert t.torch().dtype == dtype
    assert t.numpy().tolist() == data


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.int32, np.uint8, np.bool_])
def test_asarray_from_numpy_copies(dtype):
    array = (np.arange(6).reshape(2, 3) % 3).astype(dtype)
    t = kiln.asarray(array)
    assert t.shape == (2, 3) and t.numpy().dtype == array.dtype
    np.testing.assert_array_equal(t.numpy(), array)
    array[0, 0] = 2
    assert t.numpy()[0, 0] == 0, "asarray copies"


def test_asarray_converts_dtype_and_accepts_noncontiguous_numpy():
    array = np.arange(12, dtype=np.float64).reshape(3, 4).T
    t = kiln.asarray(array, dtype="float16")
    assert t.dtype == kiln.dtypes.float16 and t.shape == (4, 3)
    np.testing.assert_array_equal(t.numpy(), array.astype(np.float16))


def test_from_torch_shares_memory_both_ways():
    base = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    t = kiln.from_torch(base)
    assert t.torch() is base
    base[0, 1] = 42.0
    assert t.numpy()[0, 1] == 42.0
    t.numpy()[1, 2] = -1.0
    assert base[1, 2].item() == -1.0
    with pytest.raises(TypeError, match="from_torch expects a torch.Tensor, got list"):
        kiln.from_torch([1, 2])


def test_numpy_of_bfloat16_is_float32_and_symbolic_has_no_values():
    t = kiln.from_torch(torch.tensor([1.5, -2.0], dtype=torch.bfloat16))
    assert t.numpy().dtype == np.float32 and t.numpy().tolist() == [1.5, -2.0]
    with pytest.raises(ValueError, match="symbolic tensor has no values"):
        kiln.symbol([2]).numpy()


def test_unsupported_dtype_is_named():
    with pytest.raises(TypeError, match="unsupported data type 'complex64'"):
        kiln.zeros([2], dtype="complex64")


BINARY = [operator.add, operator.sub, operator.mul, operator.truediv,
          operator.lt, operator.le, operator.gt, operator.ge, operator.eq, operator.ne]
PAIRS = [(torch.float32, torch.float32), (torch.int32, torch.float16), (torch.int8, torch.uint8),
         (torch.int32, torch.int64), (torch.bfloat16, torch.float32), (torch.bool, torch.int16)]


def allowed(op, *dtypes) -> bool:
    """Whether torch accepts `op` on these dtypes (it rejects subtracting booleans)."""
    return not (op is operator.sub and torch.bool in dtypes)


@pytest.mark.parametrize("op, left, right", [
    pytest.param(op, left, right, id=f"{op.__name__}-{left}-{right}".replace("torch.", ""))
    for op in BINARY for left, right in PAIRS if allowed(op, left, right)])
def test_python_operators_follow_torch_promotion(op, left, right):
    x, y = rand((2, 3), left), rand((3,), right, nonzero=True)
    assert_close(op(kiln.from_torch(x), kiln.from_torch(y)), op(x, y))


@pytest.mark.parametrize("op, dtype", [
    pytest.param(op, dtype, id=f"{op.__name__}-{dtype}".replace("torch.", ""))
    for op in (operator.add, operator.sub, operator.mul, operator.truediv, operator.gt)
    for dtype in (torch.int32, torch.float16, torch.bool) if allowed(op, dtype)])
@pytest.mark.parametrize("scalar", [2, 1.5])
def test_python_operators_with_scalars(op, dtype, scalar):
    x = rand((4,), dtype)
    t = kiln.from_torch(x)
    assert_close(op(t, scalar), op(x, scalar))
    assert_close(op(scalar, t), op(scalar, x))


def test_neg_and_matmul_operators():
    x, w = rand((2, 3)), rand((3, 4))
    assert_close(-kiln.from_torch(x), -x)
    assert_close(kiln.from_torch(x) @ kiln.from_torch(w), x @ w)


def test_python_operators_on_symbolic_tensors_record_nodes():
    x = kiln.symbol([2, 3])
    y = (x * 2 - 1) / x
    assert y.is_symbolic
    graph = kiln.trace_from(y)
    assert [n.name for n in graph.nodes] == ["Mul", "Sub", "Div"]
    value = rand((2, 3), nonzero=True)
    assert_close(graph(value), (value * 2 - 1) / value)


@pytest.mark.parametrize("op", [operator.floordiv, operator.mod, operator.pow,
                                operator.and_, operator.or_, operator.xor], ids=lambda f: f.__name__)
def test_integer_python_operators_and_their_reflections(op):
    x, y = rand((2, 3), torch.int32, low=1, high=4), rand((3,), torch.int16, low=1, high=3)
    t = kiln.from_torch(x)
    assert_close(op(t, kiln.from_torch(y)), op(x, y))
    assert_close(op(t, 3), op(x, 3))
    assert_close(op(5, t), op(5, x))


def test_abs_and_invert_operators():
    x = rand((5,), torch.int8)
    assert_close(abs(kiln.from_torch(x)), abs(x))
    assert_close(~kiln.from_torch(x), ~x)
    mask = rand((5,), torch.bool)
    assert_close(~kiln.from_torch(mask), ~mask)


def test_devices_of_torch_devices(monkeypatch):
    """A torch.device names its Device (looked up once per device); 'cuda' without an index is
    the current device at each call."""
    assert kiln.device(torch.device("cpu")) == kiln.device("cpu") == kiln.Device("cpu")
    assert kiln.device(torch.device("cuda", 1)) == kiln.Device("cuda", 1)
    for current in (0, 3):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
        assert kiln.device(torch.device("cuda")) == kiln.Device("cuda", current)
    with pytest.raises(ValueError, match="unknown device 'meta'"):
        kiln.device(torch.device("meta"))
