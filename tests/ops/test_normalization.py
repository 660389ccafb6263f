"""Softmax and normalizations against PyTorch."""
import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.graph import OperatorError
from tests.support import assert_close, rand

f16, bf16, f32, f64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
TOL32 = dict(atol=1e-5, rtol=1e-4)


def _input(shape, dtype, transpose=False, **kw):
    if transpose:
        x = rand((shape[-1], *shape[1:-1], shape[0]), dtype, **kw).transpose(0, -1)
        assert not x.is_contiguous()
        return x
    return rand(shape, dtype, **kw)


def _tol(dtype):
    return TOL32 if dtype == f32 else {}


@pytest.mark.parametrize("name,ref", [("softmax", F.softmax), ("log_softmax", F.log_softmax)])
@pytest.mark.parametrize("shape,dim,dtype,transpose", [
    ((4, 7), -1, f32, False),
    ((3, 4, 5), 1, f32, True),
    ((3, 4, 5), 0, f64, False),
    ((4, 7), 1, f16, False),
    ((4, 7), 0, bf16, True),
])
def test_softmax(name, ref, shape, dim, dtype, transpose):
    x = _input(shape, dtype, transpose)
    assert_close(getattr(kiln.ops, name)(x, dim), ref(x, dim), **_tol(dtype))


@pytest.mark.parametrize("name,ref", [("softmax", F.softmax), ("log_softmax", F.log_softmax)])
def test_softmax_is_stable_and_converts_dtype(name, ref):
    x = rand((3, 6), f32, low=-200, high=200)
    assert_close(getattr(kiln.ops, name)(x, -1), ref(x, -1), **TOL32)
    h = rand((3, 6), f16)
    assert_close(getattr(kiln.ops, name)(h, 0, dtype=f32), ref(h, 0, dtype=f32), **TOL32)


def _params(shape, dtype, *names):
    """Random weight and bias (or None) of `shape`."""
    return [rand(shape, dtype) if n else None for n in names]


@pytest.mark.parametrize("shape,normalized,affine,dtype,param_dtype,transpose", [
    ((2, 3, 8), (8,), (True, True), f32, f32, False),
    ((2, 3, 8), (3, 8), (False, False), f32, f32, True),
    ((4, 6), 6, (True, False), f64, f64, False),
    ((2, 3, 8), (8,), (True, True), f16, f16, False),
    ((3, 8), (8,), (False, True), bf16, bf16, True),
    ((3, 8), (8,), (True, True), f16, f32, False),
])
def test_layer_norm(shape, normalized, affine, dtype, param_dtype, transpose):
    x = _input(shape, dtype, transpose)
    norm = (normalized,) if isinstance(normalized, int) else normalized
    weight, bias = _params(norm, param_dtype, *affine)
    result = kiln.ops.layer_norm(x, normalized, weight, bias, eps=1e-5)
    assert_close(result, F.layer_norm(x, norm, weight, bias, eps=1e-5), **_tol(dtype))


@pytest.mark.parametrize("shape,normalized,has_weight,dtype,eps,transpose", [
    ((3, 8), (8,), True, f32, None, False),
    ((2, 3, 8), (3, 8), False, f32, 1e-3, True),
    ((4, 6), (6,), True, f64, 1e-6, False),
    ((3, 8), (8,), True, f16, None, False),
    ((3, 8), (8,), False, bf16, None, True),
])
def test_rms_norm(shape, normalized, has_weight, dtype, eps, transpose):
    x = _input(shape, dtype, transpose)
    (weight,) = _params(normalized, dtype, has_weight)
    assert_close(kiln.ops.rms_norm(x, normalized, weight, eps),
                 F.rms_norm(x, normalized, weight, eps), **_tol(dtype))


@pytest.mark.parametrize("shape,groups,affine,dtype,transpose", [
    ((2, 6, 4, 3), 3, True, f32, False),
    ((2, 4, 5), 2, False, f32, True),
    ((3, 4), 4, True, f64, False),
    ((2, 6, 3, 2, 2), 2, True, f32, False),
    ((2, 4, 5), 1, True, f16, False),
    ((2, 4, 5), 2, True, bf16, True),
])
def test_group_norm(shape, groups, affine, dtype, transpose):
    x = _input(shape, dtype, transpose)
    weight, bias = _params((shape[1],), dtype, affine, affine)
    assert_close(kiln.ops.group_norm(x, groups, weight, bias, eps=1e-5),
                 F.group_norm(x, groups, weight, bias, eps=1e-5), **_tol(dtype))


@pytest.mark.parametrize("shape,affine,dtype,param_dtype,transpose", [
    ((4, 3), True, f32, f32, False),
    ((2, 3, 5), False, f32, f32, True),
    ((2, 3, 4, 5), True, f64, f64, False),
    ((2, 3, 2, 3, 2), True, f32, f32, False),
    ((2, 3, 4, 5), True, f16, f16, True),
    ((2, 3, 4), True, bf16, f32, False),
])
def test_batch_norm(shape, affine, dtype, param_dtype, transpose):
    x = _input(shape, dtype, transpose)
    c = shape[1]
    mean, weight, bias = rand((c,), param_dtype), *_params((c,), param_dtype, affine, affine)
    var = rand((c,), param_dtype, low=0.2, high=2)
    result = kiln.ops.batch_norm(x, mean, var, weight, bias, eps=1e-3)
    # PyTorch rounds intermediates to 16 bits for non-contiguous 16-bit inputs; Kiln never does
    expected = F.batch_norm(x.contiguous(), mean, var, weight, bias, training=False, eps=1e-3)
    assert_close(result, expected, **_tol(dtype))


def _x(*shape):
    return rand(shape, f32)


@pytest.mark.parametrize("call,message", [
    (lambda: kiln.ops.softmax(_x(3, 4), 2), r"^softmax: dim 2 is out of range"),
    (lambda: kiln.ops.log_softmax(_x(3, 4).int(), 1), r"^log_softmax: input dtype int32 is not supported"),
    (lambda: kiln.ops.softmax(_x(3, 4), (0, 1)), r"^softmax: dim must be an int"),
    (lambda: kiln.ops.layer_norm(_x(3, 4), (3,)), r"^layer_norm: normalized_shape \(3,\) does not match"),
    (lambda: kiln.ops.layer_norm(_x(3, 4), (2, 3, 4)), r"^layer_norm: normalized_shape .* does not match"),
    (lambda: kiln.ops.layer_norm(_x(3, 4), (4,), _x(3)), r"^layer_norm: weight has shape \(3,\), expected \(4,\)"),
    (lambda: kiln.ops.layer_norm(_x(3, 4).long(), (4,)), r"^layer_norm: input dtype int64 is not supported"),
    (lambda: kiln.ops.rms_norm(_x(3, 4), (5,)), r"^rms_norm: normalized_shape \(5,\) does not match"),
    (lambda: kiln.ops.group_norm(_x(2, 6, 3), 4), r"^group_norm: 6 channels cannot be divided into 4 groups"),
    (lambda: kiln.ops.group_norm(_x(2, 6, 3), 3, _x(3)), r"^group_norm: weight has shape \(3,\), expected \(6,\)"),
    (lambda: kiln.ops.group_norm(_x(6), 3), r"^group_norm: input shape \(6,\) must have at least 2"),
    (lambda: kiln.ops.batch_norm(_x(6), _x(6), _x(6)), r"^batch_norm: input shape \(6,\) must have 2 to 5"),
    (lambda: kiln.ops.batch_norm(_x(2, 3), _x(2), _x(3)), r"^batch_norm: running_mean has shape \(2,\)"),
    (lambda: kiln.ops.batch_norm(_x(2, 3), None, _x(3)), r"^batch_norm: inference needs running_mean"),
])
def test_bad_input_names_the_operator(call, message):
    with pytest.raises(OperatorError, match=message):
        call()
