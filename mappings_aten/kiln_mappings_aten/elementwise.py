"""Element-wise ATen operators: arithmetic, comparisons, logic, math functions, activations and
casts; most share the signature of a Kiln operator."""
from kiln import ops
from kiln.frontend.torch import register_function

from kiln_mappings_aten.common import aten, identity, same_signature

for _name, _overloads in {
    "add": ("Tensor", "Scalar"), "sub": ("Tensor", "Scalar"), "mul": ("Tensor", "Scalar"),
    "div": ("Tensor", "Scalar", "Tensor_mode", "Scalar_mode"),
    "remainder": ("Tensor", "Scalar"), "fmod": ("Tensor", "Scalar"),
    "pow": ("Tensor_Scalar", "Tensor_Tensor"), "atan2": ("default",),
    "maximum": ("default",), "minimum": ("default",),
    "eq": ("Tensor", "Scalar"), "ne": ("Tensor", "Scalar"), "lt": ("Tensor", "Scalar"),
    "le": ("Tensor", "Scalar"), "gt": ("Tensor", "Scalar"), "ge": ("Tensor", "Scalar"),
    "logical_and": ("default",), "logical_or": ("default",), "logical_xor": ("default",),
    "bitwise_and": ("Tensor", "Scalar"), "bitwise_or": ("Tensor", "Scalar"),
    "bitwise_xor": ("Tensor", "Scalar"),
    "where": ("self",), "clamp": ("default",),
}.items():
    same_signature(_name, *(getattr(getattr(aten, _name), o) for o in _overloads))

for _name in ("neg", "abs", "exp", "exp2", "expm1", "log", "log1p", "log2", "log10", "sqrt",
              "rsqrt", "reciprocal", "sin", "cos", "tan", "tanh", "asin", "acos", "atan", "sinh",
              "cosh", "erf", "erfc", "erfinv", "floor", "ceil", "round", "trunc", "sign", "sigmoid",
              "relu", "gelu", "silu", "mish", "hardtanh", "hardsigmoid", "hardswish", "leaky_relu",
              "softplus", "isnan", "isinf", "logical_not", "bitwise_not", "lgamma",
              "digamma"):
    same_signature(_name, getattr(aten, _name).default)

identity(aten.clone.default, aten.alias.default, aten.lift_fresh_copy.default,
         aten.detach.default, aten.contiguous.default)


@register_function(aten.clamp_min.default)
def clamp_min(x, min):
    return ops.clamp(x, min=min)


@register_function(aten.clamp_max.default)
def clamp_max(x, max):
    return ops.clamp(x, max=max)


@register_function(aten.pow.Scalar)
def pow_scalar(base, exponent):
    """A Python number raised to a tensor."""
    return ops.pow(ops.full(exponent.shape, base, dtype=exponent.dtype, device=exponent.device),
                   exponent)


def _same_device(x, dtype=None, layout=None, device=None, pin_memory=None, non_blocking=False,
                 memory_format=None) -> bool:
    return device is None or ops.full([], 0, device=device).device == x.device


@register_function(aten._to_copy.default, check=_same_device)
def to_copy(x, dtype=None, layout=None, device=None, pin_memory=None, non_blocking=False,
            memory_format=None):
    """A cast (a copy to another device is declined)."""
    return x if dtype is None or dtype == x.dtype.torch_dtype else ops.cast(x, dtype)


def _one_device(x, src, non_blocking=False) -> bool:
    return src.device == x.device


@register_function(aten.copy.default, check=_one_device)
def copy(x, src, non_blocking=False):
    """`src` in `x`'s dtype and shape: the functional form of `x.copy_(src)`."""
    return ops.broadcast_to(ops.cast(src, x.dtype), x.shape)
