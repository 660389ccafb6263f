"""Reductions and cumsum against PyTorch."""
import pytest
import torch

import kiln
from kiln.graph import OperatorError
from tests.support import assert_close, rand

f16, bf16, f32, f64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
i8, i16, i32, i64, u8, b = torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool

# (kiln op, torch function, input shape, dtype, keyword arguments, transpose the input)
CASES = [
    ("sum", torch.sum, (3, 4, 5), f32, dict(dim=(0, 2), keepdim=True), False),
    ("sum", torch.sum, (3, 4, 5), f64, dict(dim=-1), True),
    ("sum", torch.sum, (4, 6), f16, dict(), False),
    ("sum", torch.sum, (4, 6), bf16, dict(dim=1, keepdim=True), False),
    ("sum", torch.sum, (3, 4, 5), i32, dict(dim=[-1, 0]), True),
    ("sum", torch.sum, (4, 6), i8, dict(dim=0, dtype=torch.float64), False),
    ("sum", torch.sum, (4, 6), b, dict(), False),
    ("sum", torch.sum, (), f32, dict(dim=0), False),
    ("prod", torch.prod, (3, 5), f32, dict(dim=1), True),
    ("prod", torch.prod, (3, 5), i16, dict(dim=0, keepdim=True), False),
    ("prod", torch.prod, (3, 5), b, dict(), False),
    ("prod", torch.prod, (3, 5), bf16, dict(dim=-1), False),
    ("mean", torch.mean, (3, 4, 5), f32, dict(dim=(1, -1)), True),
    ("mean", torch.mean, (3, 4, 5), f16, dict(dim=1, keepdim=True), False),
    ("mean", torch.mean, (4, 6), bf16, dict(), False),
    ("mean", torch.mean, (4, 6), i32, dict(dim=0, dtype=torch.float64), False),
    ("amax", torch.amax, (3, 4, 5), f32, dict(dim=(0, 1), keepdim=True), True),
    ("amax", torch.amax, (3, 4, 5), i8, dict(dim=-1), False),
    ("amax", torch.amax, (4, 6), b, dict(dim=0), False),
    ("amin", torch.amin, (4, 6), f16, dict(dim=1), False),
    ("amin", torch.amin, (4, 6), u8, dict(), True),
    ("max", torch.max, (3, 4, 5), f64, dict(), False),
    ("min", torch.min, (3, 4, 5), i64, dict(), True),
    ("max_dim", torch.max, (3, 4, 5), f32, dict(dim=1), True),
    ("max_dim", torch.max, (4, 6), bf16, dict(dim=-1, keepdim=True), False),
    ("min_dim", torch.min, (4, 6), f64, dict(dim=0, keepdim=True), False),
    ("argmax", torch.argmax, (3, 4, 5), f32, dict(), True),
    ("argmax", torch.argmax, (3, 4, 5), i32, dict(dim=1, keepdim=True), False),
    ("argmax", torch.argmax, (4, 6), f16, dict(dim=-1), False),
    ("argmin", torch.argmin, (4, 6), i8, dict(keepdim=True), False),
    ("argmin", torch.argmin, (3, 4, 5), f64, dict(dim=0), True),
    ("var", torch.var, (3, 4, 5), f32, dict(dim=(0, 2)), True),
    ("var", torch.var, (4, 6), f64, dict(dim=1, correction=0, keepdim=True), False),
    ("var", torch.var, (4, 6), f16, dict(), False),
    ("var", torch.var, (4, 6), f32, dict(dim=0, unbiased=False), False),
    ("std", torch.std, (3, 4, 5), f32, dict(dim=-1, correction=2), True),
    ("std", torch.std, (4, 6), bf16, dict(dim=0, keepdim=True), False),
    ("all", torch.all, (3, 4, 5), i32, dict(dim=(1, 2)), True),
    ("all", torch.all, (4, 6), b, dict(dim=0, keepdim=True), False),
    ("all", torch.all, (4, 6), u8, dict(), False),
    ("any", torch.any, (3, 4, 5), f32, dict(dim=-1), False),
    ("any", torch.any, (4, 6), b, dict(dim=1), True),
    ("any", torch.any, (4, 6), i8, dict(), False),
    ("cumsum", torch.cumsum, (3, 4, 5), f32, dict(dim=1), True),
    ("cumsum", torch.cumsum, (4, 6), f64, dict(dim=-1), False),
    ("cumsum", torch.cumsum, (4, 6), f16, dict(dim=0), False),
    ("cumsum", torch.cumsum, (4, 6), i16, dict(dim=1), False),
    ("cumsum", torch.cumsum, (4, 6), b, dict(dim=0), False),
    ("cumsum", torch.cumsum, (4, 6), i32, dict(dim=1, dtype=torch.float32), True),
]

# small integers so that all/any see zeros and products do not overflow
LOW_HIGH = {"all": (-1, 1), "any": (-1, 1), "prod": (-2, 2)}


def _input(name, shape, dtype, transpose):
    low, high = LOW_HIGH.get(name, (-3, 3))
    if name == "prod" and dtype.is_floating_point:
        low, high = 0.5, 1.5
    x = rand(shape, dtype, low=low, high=high)
    if transpose:
        x = rand((shape[-1], *shape[1:-1], shape[0]), dtype, low=low, high=high).transpose(0, -1)
        assert not x.is_contiguous()
    return x


def _tolerance(name, dtype):
    """Sums in a different order than PyTorch's differ by rounding; integers must match exactly."""
    if dtype == f32 and name not in ("amax", "amin", "max", "min", "max_dim", "min_dim"):
        return dict(atol=1e-4, rtol=1e-4)
    return {}


@pytest.mark.parametrize("name,ref,shape,dtype,kwargs,transpose", CASES,
                         ids=[f"{c[0]}-{c[3]}-{c[2]}-{c[4]}{'-T' if c[5] else ''}".replace("torch.", "")
                              for c in CASES])
def test_matches_torch(name, ref, shape, dtype, kwargs, transpose):
    x = _input(name, shape, dtype, transpose)
    result = getattr(kiln.ops, name)(x, **kwargs)
    expected = ref(x, **kwargs)
    assert_close(result, tuple(expected) if name.endswith("_dim") else expected, **_tolerance(name, dtype))


def test_reuses_compiled_kernel_for_new_values():
    for _ in range(2):
        x = rand((4, 6), f32)
        assert_close(kiln.ops.sum(x, dim=1), x.sum(1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name,ref", [("amax", torch.amax), ("argmax", torch.argmax),
                                      ("max_dim", torch.max), ("argmin", torch.argmin)])
def test_nan_propagates_like_torch(name, ref):
    x = rand((3, 5), f32)
    x[1, 2] = x[2, 0] = x[2, 3] = float("nan")
    expected = ref(x, 1)
    assert_close(getattr(kiln.ops, name)(x, 1), tuple(expected) if name == "max_dim" else expected)


def test_integer_ties_take_the_first_position():
    x = torch.tensor([[1, 3, 3, 0], [2, 2, -1, 2]], dtype=torch.int32)
    assert_close(kiln.ops.argmax(x, 1), torch.tensor([1, 0]))
    assert_close(kiln.ops.argmin(x, 0), torch.tensor([0, 1, 1, 0]))
    assert_close(kiln.ops.max_dim(x, 1), (torch.tensor([3, 2], dtype=torch.int32), torch.tensor([1, 0])))


@pytest.mark.parametrize("call,message", [
    (lambda x: kiln.ops.sum(x, dim=2), r"^sum: dim 2 is out of range"),
    (lambda x: kiln.ops.amax(x, dim=(0, -2)), r"^amax: dim .* more than once"),
    (lambda x: kiln.ops.mean(x.int()), r"^mean: input dtype int32 is not supported"),
    (lambda x: kiln.ops.var(x.long(), 0), r"^var: input dtype int64 is not supported"),
    (lambda x: kiln.ops.argmax(x > 0), r"^argmax: bool input"),
    (lambda x: kiln.ops.argmin(x, dim=(0, 1)), r"^argmin: dim must be an int"),
    (lambda x: kiln.ops.max_dim(x, None), r"^max_dim: dim must be an int"),
    (lambda x: kiln.ops.cumsum(x, -3), r"^cumsum: dim -3 is out of range"),
    (lambda x: kiln.ops.sum(x[:, :0], 1), r"^sum: cannot reduce over dimension 1 of size 0"),
    (lambda x: kiln.ops.argmax(x[:0]), r"^argmax: cannot reduce over dimension 0 of size 0"),
])
def test_bad_input_names_the_operator(call, message):
    with pytest.raises(OperatorError, match=message):
        call(rand((3, 4), f32))


def test_empty_kept_dimension_gives_an_empty_result():
    x = rand((0, 3), f32)
    assert_close(kiln.ops.sum(x, 1), x.sum(1))
