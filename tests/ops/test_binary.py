"""Binary element-wise operators against PyTorch: broadcasting, type promotion, Python scalars."""
import pytest
import torch

import kiln
from kiln.graph import OperatorError
from tests.support import assert_close, rand

FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INTS = [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8]
NUMERIC = FLOATS + INTS
ALL = NUMERIC + [torch.bool]


def _divisor(shape, dtype):
    return rand(shape, dtype, nonzero=True)


def _exponent(shape, dtype):
    return rand(shape, dtype, low=0 if dtype in INTS else -2, high=3 if dtype in INTS else 2)


def _base(shape, dtype):
    return rand(shape, dtype, low=0.5 if dtype in FLOATS else -3, high=2 if dtype in FLOATS else 3)


def _shift(shape, dtype):
    bits = torch.iinfo(dtype).bits
    return torch.randint(0 if dtype == torch.uint8 else -1, bits + 2, shape).to(dtype)


def _signed(shape, dtype):
    return rand(shape, dtype, low=-100, high=100)


# case: (operator, also torch.<operator>; dtypes; make x; make y; keyword arguments)
BINARY = {
    "add": ("add", ALL, rand, rand, {}),
    "add_alpha": ("add", NUMERIC, rand, rand, {"alpha": 2}),
    "sub": ("sub", NUMERIC, rand, rand, {}),
    "sub_alpha": ("sub", FLOATS, rand, rand, {"alpha": 0.3}),
    "mul": ("mul", ALL, rand, rand, {}),
    "div": ("div", ALL, rand, _divisor, {}),
    "div_trunc": ("div", NUMERIC, rand, _divisor, {"rounding_mode": "trunc"}),
    "div_floor": ("div", NUMERIC, rand, _divisor, {"rounding_mode": "floor"}),
    "floor_divide": ("floor_divide", NUMERIC, rand, _divisor, {}),
    "remainder": ("remainder", NUMERIC, rand, _divisor, {}),
    "fmod": ("fmod", NUMERIC, rand, _divisor, {}),
    "pow": ("pow", NUMERIC, _base, _exponent, {}),
    "atan2": ("atan2", ALL, rand, rand, {}),
    "maximum": ("maximum", ALL, rand, rand, {}),
    "minimum": ("minimum", ALL, rand, rand, {}),
    "eq": ("eq", ALL, rand, rand, {}),
    "ne": ("ne", ALL, rand, rand, {}),
    "lt": ("lt", ALL, rand, rand, {}),
    "le": ("le", ALL, rand, rand, {}),
    "gt": ("gt", ALL, rand, rand, {}),
    "ge": ("ge", ALL, rand, rand, {}),
    "logical_and": ("logical_and", ALL, rand, rand, {}),
    "logical_or": ("logical_or", ALL, rand, rand, {}),
    "logical_xor": ("logical_xor", ALL, rand, rand, {}),
    "bitwise_and": ("bitwise_and", INTS + [torch.bool], _signed, _signed, {}),
    "bitwise_or": ("bitwise_or", INTS + [torch.bool], _signed, _signed, {}),
    "bitwise_xor": ("bitwise_xor", INTS + [torch.bool], _signed, _signed, {}),
    "bitwise_left_shift": ("bitwise_left_shift", INTS, _signed, _shift, {}),
    "bitwise_right_shift": ("bitwise_right_shift", INTS, _signed, _shift, {}),
}
CASES = [(case, dtype) for case, (_, dtypes, *_) in BINARY.items() for dtype in dtypes]


def _check(case, x, y):
    name, _, _, _, kwargs = BINARY[case]
    # Not every torch function takes Python scalars; a 0-d tensor of the same category (bool,
    # integer, float) as the scalar promotes the same way.
    tx, ty = (v if isinstance(v, torch.Tensor) else torch.tensor(v) for v in (x, y))
    assert_close(getattr(kiln.ops, name)(x, y, **kwargs), getattr(torch, name)(tx, ty, **kwargs))


@pytest.mark.parametrize("case, dtype", CASES, ids=[f"{c}-{str(d)[6:]}" for c, d in CASES])
def test_binary_dtypes(case, dtype):
    _, _, make_x, make_y, _ = BINARY[case]
    x = make_x((5, 4), dtype).t()  # non-contiguous, broadcast against y
    _check(case, x, make_y((4, 1), dtype))


SCALARS = {torch.float32: (1.5, -0.75), torch.int32: (3, -2)}  # (as other, as input)


@pytest.mark.parametrize("layout", ["both-broadcast", "zero-dim", "scalar-other", "scalar-input"])
@pytest.mark.parametrize("case", list(BINARY))
def test_binary_shapes(case, layout):
    _, dtypes, make_x, make_y, _ = BINARY[case]
    dtype = torch.float32 if torch.float32 in dtypes else torch.int32
    scalar = 2 if case == "pow" else SCALARS[dtype][layout == "scalar-input"]
    x, y = {
        "both-broadcast": lambda: (make_x((2, 1, 3), dtype), make_y((4, 3), dtype)),
        "zero-dim": lambda: (make_x((), dtype), make_y((), dtype)),
        "scalar-other": lambda: (make_x((2, 3), dtype), scalar),
        "scalar-input": lambda: (scalar, make_y((2, 3), dtype)),
    }[layout]()
    _check(case, x, y)


@pytest.mark.parametrize("x, y", [
    (rand((3, 4), torch.int8), rand((4,), torch.uint8)),           # -> int16
    (rand((3, 4), torch.int32), rand((4,), torch.float16)),        # -> float16
    (rand((3, 4), torch.bool), rand((4,), torch.int16)),           # -> int16
    (rand((3, 4), torch.float16), rand((4,), torch.bfloat16)),     # -> float32
    (rand((3, 4), torch.int32), rand((), torch.float64)),          # 0-d float lifts the category
    (rand((3, 4), torch.int8), rand((), torch.int64)),             # 0-d int does not widen
    (rand((3, 4), torch.float16), rand((), torch.float64)),        # 0-d float does not widen
    (rand((), torch.int8), 2.5),                                   # -> float32
    (rand((3, 4), torch.uint8), -1),                               # -> uint8 (wraps)
    (rand((3, 4), torch.bool), True),                              # -> bool
    (rand((3, 4), torch.float16), 0.1),                            # scalar rounds to float16
], ids=lambda v: str(v.dtype)[6:] if isinstance(v, torch.Tensor) else repr(v))
@pytest.mark.parametrize("name", ["add", "gt"])
def test_promotion(name, x, y):
    assert_close(getattr(kiln.ops, name)(x, y), getattr(torch, name)(x, y))


def test_scalar_takes_16bit_type():
    # PyTorch compares with the scalar converted to float16: 0.1 equals float16(0.1).
    x = torch.tensor([0.1, 2.3, 0.2], dtype=torch.float16)
    assert_close(kiln.ops.eq(x, 0.1), torch.eq(x, 0.1))
    assert_close(kiln.ops.ge(x, 2.3), torch.ge(x, 2.3))


@pytest.mark.parametrize("name", ["maximum", "minimum", "div", "floor_divide", "remainder", "fmod"])
def test_nan_inf_and_zero(name):
    nan, inf = float("nan"), float("inf")
    x = torch.tensor([nan, 1.0, inf, -inf, 0.0, 2.5, -3.0, 1.0])
    y = torch.tensor([1.0, nan, 2.0, 0.0, 0.0, 0.0, inf, -inf])
    assert_close(getattr(kiln.ops, name)(x, y), getattr(torch, name)(x, y))


def test_true_division_of_integers():
    x, y = rand((3, 4), torch.int32), rand((4,), torch.int64, nonzero=True)
    assert_close(kiln.ops.div(x, y), torch.div(x, y))
    assert_close(kiln.ops.div(7, y), torch.div(7, y))


def test_tensor_operators():
    x, y = kiln.from_torch(rand((3, 4))), kiln.from_torch(rand((4,), nonzero=True))
    a, b = x.torch(), y.torch()
    for got, want in [(x + y, a + b), (x - 2, a - 2), (2 - x, 2 - a), (x * y, a * b), (3 * x, 3 * a),
                      (x / y, a / b), (2 / y, 2 / b), (x // y, a // b), (3 // y, 3 // b),
                      (x % y, a % b), (3 % y, 3 % b), (abs(x) ** y, a.abs() ** b), (2 ** x, 2 ** a),
                      (-x, -a), (abs(x), a.abs()), (x < y, a < b), (x <= y, a <= b), (x > y, a > b),
                      (x >= y, a >= b), (x == y, a == b), (x != y, a != b)]:
        assert_close(got, want)
    i, j = kiln.from_torch(rand((3, 4), torch.int32)), kiln.from_torch(rand((4,), torch.int32))
    p, q = i.torch(), j.torch()
    for got, want in [(~i, ~p), (i & j, p & q), (i | j, p | q), (i ^ j, p ^ q), (6 & i, 6 & p),
                      (6 | i, 6 | p), (6 ^ i, 6 ^ p)]:
        assert_close(got, want)


def test_traced_graph_with_scalars():
    x = kiln.symbol((2, 3))
    graph = kiln.trace_from(kiln.ops.where(x > 0, 1.5 - x * 2, 0.5))
    a = rand((2, 3))
    assert_close(graph(a), torch.where(a > 0, 1.5 - a * 2, 0.5))


@pytest.mark.parametrize("call, message", [
    (lambda: kiln.ops.add(rand((3, 4)), rand((5,))), r"add: shapes \(3, 4\) and \(5,\) cannot be broadcast"),
    (lambda: kiln.ops.add(1, 2), "add: at least one operand must be a tensor"),
    (lambda: kiln.ops.mul(rand((3,)), "2"), "mul: operand '2' is neither a tensor nor a Python scalar"),
    (lambda: kiln.ops.where(rand((3,), torch.bool), rand((3,)), None), "where: operand None is neither"),
    (lambda: kiln.ops.add(rand((3,), torch.int32), rand((3,), torch.int32), alpha=0.5),
     "add: alpha=0.5 is a float, but the operands are of type int32"),
    (lambda: kiln.ops.sub(rand((3,), torch.bool), rand((3,), torch.bool)), "sub: subtracting bool"),
    (lambda: kiln.ops.div(rand((3,)), rand((3,)), rounding_mode="round"), "div: rounding_mode must be"),
    (lambda: kiln.ops.div(rand((3,), torch.bool), True, rounding_mode="floor"),
     "div: unsupported dtype bool"),
    (lambda: kiln.ops.remainder(rand((3,), torch.bool), rand((3,), torch.bool)),
     "remainder: unsupported dtype bool"),
    (lambda: kiln.ops.pow(rand((3,), torch.int32), -1), "pow: integers to negative integer powers"),
    (lambda: kiln.ops.bitwise_and(rand((3,)), rand((3,), torch.int32)),
     r"bitwise_and: unsupported dtype float32 \(operands: float32, int32\); expected integer or bool"),
    (lambda: kiln.ops.bitwise_or(rand((3,), torch.int32), 1.5), "bitwise_or: unsupported dtype float32"),
    (lambda: kiln.ops.bitwise_left_shift(rand((3,), torch.bool), rand((3,), torch.bool)),
     "bitwise_left_shift: unsupported dtype bool"),
])
def test_binary_errors(call, message):
    with pytest.raises(OperatorError, match=message):
        call()


@pytest.mark.parametrize("exponent", [2, 2.0, 3, 3.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32], ids=str)
def test_squares_and_cubes_are_products_as_in_pytorch(exponent, dtype):
    """x ** 2 and x ** 3 are x * x and x * x * x, bit for bit PyTorch's (pow's math library call
    is neither exact nor cheap); the program holds no pow call. A bfloat16 cube is the float
    product rounded once, as PyTorch's CUDA kernel computes it (its CPU kernel rounds x * x too)."""
    from kiln.schedule.choose import choose
    x = rand((5, 37), dtype)
    symbol = kiln.symbol((5, 37), str(dtype)[6:], "cpu")
    graph = kiln.trace_from(kiln.ops.pow(symbol, exponent), [symbol])
    for target in ("cpu", "cuda"):
        assert "pow" not in choose(graph.nodes[0].task, target).source.split("kiln_max_i64")[-1]
    expected = (x.float() ** 3).to(dtype) if dtype == torch.bfloat16 and exponent == 3 else torch.pow(x, exponent)
    torch.testing.assert_close(graph(x).torch(), expected, rtol=0, atol=0)
