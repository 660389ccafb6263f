"""Element-wise math, comparisons and logic: torch functions, Tensor methods, `operator`."""
import operator

import torch
import torch.nn.functional as F

from kiln import ops
from kiln.frontend.torch import register_function, register_method

from kiln_mappings_builtin.common import direct, is_tensor

UNARY = ("abs", "neg", "exp", "expm1", "log", "log1p", "log2", "sqrt", "rsqrt", "sin", "cos",
         "tan", "tanh", "sigmoid", "erf", "floor", "ceil", "trunc", "sign", "reciprocal",
         "isnan", "isinf", "isfinite", "logical_not", "bitwise_not", "relu", "round")
BINARY = ("sub", "mul", "div", "floor_divide", "pow", "maximum", "minimum", "remainder", "fmod",
          "atan2", "eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_xor",
          "bitwise_and", "bitwise_or", "bitwise_xor", "bitwise_left_shift", "bitwise_right_shift",
          "clamp", "add")
ACTIVATIONS = ("relu", "gelu", "silu", "hardtanh", "relu6", "hardsigmoid", "hardswish",
               "leaky_relu", "elu", "selu", "celu", "softplus", "mish", "logsigmoid", "softsign",
               "sigmoid", "tanh")
ALIASES = {"negative": "neg", "absolute": "abs", "multiply": "mul", "divide": "div",
           "subtract": "sub", "true_divide": "div", "greater": "gt", "greater_equal": "ge",
           "less": "lt", "less_equal": "le", "not_equal": "ne", "clip": "clamp",
           "special_expit": "sigmoid", "fix": "trunc"}
OPERATORS = {operator.add: "add", operator.sub: "sub", operator.mul: "mul",
             operator.truediv: "div", operator.floordiv: "floor_divide", operator.mod: "remainder",
             operator.pow: "pow", operator.matmul: "matmul", operator.lt: "lt", operator.le: "le",
             operator.gt: "gt", operator.ge: "ge", operator.eq: "eq", operator.ne: "ne",
             operator.and_: "bitwise_and", operator.or_: "bitwise_or",
             operator.xor: "bitwise_xor", operator.lshift: "bitwise_left_shift",
             operator.rshift: "bitwise_right_shift", operator.neg: "neg", operator.abs: "abs",
             operator.invert: "bitwise_not"}


def _torch_functions(name: str) -> list:
    """torch.NAME, torch.special.NAME and torch.nn.functional.NAME, once each."""
    found = (getattr(namespace, name, None) for namespace in (torch, torch.special, F))
    return list(dict.fromkeys(f for f in found if callable(f)))


def _operator_rule(op: str):
    def rule(*args):
        return getattr(ops, op)(*args)
    rule.__name__ = rule.__qualname__ = f"operator_{op}"
    return rule


for _name in dict.fromkeys(UNARY + BINARY + ACTIVATIONS):
    direct(_name, _torch_functions(_name), [_name])
for _alias, _op in ALIASES.items():
    direct(_op, _torch_functions(_alias), [_alias])
for _target, _op in OPERATORS.items():
    _inplace = getattr(operator, f"i{_target.__name__.rstrip('_')}", None)
    _rule = _operator_rule(_op)
    register_function(_target, *([_inplace] if _inplace else []),
                      check=lambda *a: any(map(is_tensor, a)))(_rule)
    register_method(f"__{_target.__name__.rstrip('_')}__")(_rule)


@register_function(operator.pos)
@register_method("__pos__", "positive")
@register_function(torch.positive)
def positive(x):
    return x


@register_function(torch.square)
@register_method(torch.Tensor.square)
def square(input):
    return ops.mul(input, input)


@register_function(torch.rsub)
@register_method(torch.Tensor.__rsub__)
def rsub(input, other, alpha=1):
    return ops.sub(other, input, alpha=alpha)


direct("where", [torch.where])


@register_method("where")
def where_method(self, condition, other):
    return ops.where(condition, self, other)


@register_function(torch.clamp_min)
@register_method(torch.Tensor.clamp_min)
def clamp_min(input, min):
    return ops.clamp(input, min=min)


@register_function(torch.clamp_max)
@register_method(torch.Tensor.clamp_max)
def clamp_max(input, max):
    return ops.clamp(input, max=max)


@register_function(torch.masked_fill)
@register_method(torch.Tensor.masked_fill)
def masked_fill(input, mask, value):
    value = ops.cast(value, input.dtype) if is_tensor(value) else value
    return ops.cast(ops.where(mask, value, input), input.dtype)


@register_function(torch.lerp)
@register_method(torch.Tensor.lerp)
def lerp(input, end, weight):
    return ops.add(input, ops.mul(weight, ops.sub(end, input)))


@register_function(torch.addcmul)
@register_method(torch.Tensor.addcmul)
def addcmul(input, tensor1, tensor2, *, value=1):
    return ops.add(input, ops.mul(ops.mul(tensor1, tensor2), value))


@register_function(torch.addcdiv)
@register_method(torch.Tensor.addcdiv)
def addcdiv(input, tensor1, tensor2, *, value=1):
    return ops.add(input, ops.mul(ops.div(tensor1, tensor2), value))


@register_function(torch.diff)
@register_method("diff")
def diff(input, n=1, dim=-1, prepend=None, append=None):
    """The n-th forward difference along `dim` (`!=` for bool tensors, as torch does)."""
    parts = [t for t in (prepend, input, append) if t is not None]
    x = ops.concat(parts, dim) if len(parts) > 1 else input
    for _ in range(n):
        later, earlier = ops.slice(x, dim, 1, None), ops.slice(x, dim, 0, -1)
        x = ops.ne(later, earlier) if x.dtype.is_bool else ops.sub(later, earlier)
    return x
