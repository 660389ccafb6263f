"""Softmax and normalizations: softmax, log_softmax, layer_norm, group_norm, rms_norm and
batch_norm (inference).

Statistics of 16-bit inputs are computed in float32; results have the input's type.
"""
from __future__ import annotations

import torch

from kiln import dtypes
from kiln.graph import Layout, OperatorError, Traits, operator
from kiln.ir import cast, compute, exp, log, rsqrt

from kiln_ops_builtin.common import accumulator_type, normalize_dim
from kiln_ops_builtin.reduce import Reduction, moments, require_float


def _check_param(op: str, name: str, t, shape) -> None:
    """Check an optional parameter tensor (weight, bias, running statistics) has `shape`."""
    if t is not None and t.shape != tuple(shape):
        raise OperatorError(f"{op}: {name} has shape {t.shape}, expected {tuple(shape)}")
    if t is not None and not t.dtype.is_float:
        raise OperatorError(f"{op}: {name} has dtype {t.dtype}, expected a floating-point tensor")


def _affine(value, weight, bias, index, acc):
    """`value * weight[index] + bias[index]`, either parameter optional, computed in `acc`."""
    if weight is not None:
        value = value * cast(weight[index], acc)
    if bias is not None:
        value = value + cast(bias[index], acc)
    return value


def _softmax(op: str, x, dim, dtype, finish):
    """Numerically stable softmax along `dim`: `finish(shifted, log_sum)`, where `shifted` is
    x - max and `log_sum` a function giving the sum of exp(shifted)."""
    out = dtypes.data_type(dtype) if dtype is not None else x.dtype
    require_float(op, out)
    acc = accumulator_type(out)
    red = Reduction(op, x, normalize_dim(op, dim, x.ndim))
    high = red.compute(lambda i: cast(x[i], acc), "max", acc)
    total = red.compute(lambda i: exp(cast(x[i], acc) - high[red.project(i)]), "sum", acc)

    def element(*i):
        s = red.project(i)
        return finish(cast(x[i], acc) - high[s], total[s])

    return compute(x.shape, element, dtype=out)


@operator("softmax", traits=Traits(layout=Layout.ALONG_DIM))
def softmax(x, dim, dtype=None):
    """exp(x) / sum(exp(x)) along `dim`, after converting to `dtype` if given."""
    return _softmax("softmax", x, dim, dtype, lambda shifted, total: exp(shifted) / total)


@operator("log_softmax", traits=Traits(layout=Layout.ALONG_DIM))
def log_softmax(x, dim, dtype=None):
    """x - log(sum(exp(x))) along `dim`, after converting to `dtype` if given."""
    return _softmax("log_softmax", x, dim, dtype, lambda shifted, total: shifted - log(total))


def _normalized_dims(op: str, x, normalized_shape) -> int:
    """The number of leading dimensions of `x` that are not normalized."""
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if not shape or len(shape) > x.ndim or x.shape[x.ndim - len(shape):] != shape:
        raise OperatorError(f"{op}: normalized_shape {shape} does not match the trailing "
                            f"dimensions of the input shape {x.shape}")
    if 0 in shape:
        raise OperatorError(f"{op}: normalized_shape {shape} has a dimension of size 0")
    return x.ndim - len(shape)


@operator("layer_norm")
def layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    """Normalize over the trailing `normalized_shape` dims to mean 0 and variance 1, then scale
    by `weight` and shift by `bias` (each of `normalized_shape`, optional)."""
    require_float("layer_norm", x.dtype)
    lead = _normalized_dims("layer_norm", x, normalized_shape)
    for name, t in (("weight", weight), ("bias", bias)):
        _check_param("layer_norm", name, t, x.shape[lead:])
    acc = accumulator_type(x.dtype)
    red = Reduction("layer_norm", x, list(range(lead, x.ndim)))
    mean, var = moments(red.shape, red.extents, lambda s, r: cast(x[red.index(s, r)], acc), acc)

    def element(*i):
        s = i[:lead]
        value = (cast(x[i], acc) - mean[s]) * rsqrt(var[s] + eps)
        return _affine(value, weight, bias, i[lead:], acc)

    return compute(x.shape, element, dtype=x.dtype)


@operator("rms_norm")
def rms_norm(x, normalized_shape, weight=None, eps=None):
    """x / sqrt(mean(x**2) + eps) over the trailing `normalized_shape` dims, times `weight`;
    `eps` defaults to the machine epsilon of x's dtype, as in PyTorch."""
    require_float("rms_norm", x.dtype)
    lead = _normalized_dims("rms_norm", x, normalized_shape)
    _check_param("rms_norm", "weight", weight, x.shape[lead:])
    if eps is None:
        eps = torch.finfo(x.dtype.torch_dtype).eps
    acc = accumulator_type(x.dtype)
    red = Reduction("rms_norm", x, list(range(lead, x.ndim)))

    def square(i):
        v = cast(x[i], acc)
        return v * v

    scale = red.compute(square, "sum", acc, finish=lambda v: rsqrt(v / red.count + eps))
    return compute(x.shape, lambda *i: _affine(cast(x[i], acc) * scale[i[:lead]], weight, None, i[lead:], acc),
                   dtype=x.dtype)


@operator("group_norm")
def group_norm(x, num_groups, weight=None, bias=None, eps=1e-5):
    """Normalize x of shape (N, C, *) over each group of C / num_groups channels (and all
    spatial positions), then scale and shift per channel by `weight` and `bias` of shape (C,)."""
    require_float("group_norm", x.dtype)
    if x.ndim < 2:
        raise OperatorError(f"group_norm: input shape {x.shape} must have at least 2 dimensions (N, C, *)")
    n, c, spatial = x.shape[0], x.shape[1], list(x.shape[2:])
    if not isinstance(num_groups, int) or num_groups <= 0 or c % num_groups:
        raise OperatorError(f"group_norm: {c} channels cannot be divided into {num_groups!r} groups")
    for name, t in (("weight", weight), ("bias", bias)):
        _check_param("group_norm", name, t, (c,))
    if 0 in spatial:
        raise OperatorError(f"group_norm: input shape {x.shape} is empty; empty inputs are not supported")
    per_group = c // num_groups
    acc = accumulator_type(x.dtype)
    mean, var = moments((n, num_groups), [per_group] + spatial,
                        lambda s, r: cast(x[s[0], s[1] * per_group + r[0], *r[1:]], acc), acc)

    def element(*i):
        s = (i[0], i[1] // per_group)
        value = (cast(x[i], acc) - mean[s]) * rsqrt(var[s] + eps)
        return _affine(value, weight, bias, i[1], acc)

    return compute(x.shape, element, dtype=x.dtype)


@operator("batch_norm", traits=Traits(layout=Layout.OWN_DEFINITION))
def batch_norm(x, running_mean, running_var, weight=None, bias=None, eps=1e-5):
    """Inference batch normalization of x of shape (N, C, *) (2-D to 5-D) with per-channel
    running statistics, then per-channel `weight` and `bias`, each of shape (C,)."""
    require_float("batch_norm", x.dtype)
    if not 2 <= x.ndim <= 5:
        raise OperatorError(f"batch_norm: input shape {x.shape} must have 2 to 5 dimensions (N, C, *)")
    c = x.shape[1]
    if running_mean is None or running_var is None:
        raise OperatorError("batch_norm: inference needs running_mean and running_var tensors")
    params = (("running_mean", running_mean), ("running_var", running_var), ("weight", weight), ("bias", bias))
    for name, t in params:
        _check_param("batch_norm", name, t, (c,))
    acc = accumulator_type(x.dtype)

    def element(*i):
        ch = i[1]
        value = (cast(x[i], acc) - cast(running_mean[ch], acc)) * rsqrt(cast(running_var[ch], acc) + eps)
        return _affine(value, weight, bias, ch, acc)

    return compute(x.shape, element, dtype=x.dtype)
