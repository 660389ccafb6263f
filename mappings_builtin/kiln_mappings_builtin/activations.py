"""Activations composed from element-wise operators: glu, hardshrink, softshrink, tanhshrink,
softmin, threshold, prelu and rrelu (inference), with their nn.Module forms."""
import torch
import torch.nn.functional as F
from torch import nn

from kiln import ops
from kiln.frontend.torch import KilnModule, register_function, register_method, register_module


@register_function(F.glu)
def glu(input, dim=-1):
    a, b = ops.chunk(input, 2, dim)
    return ops.mul(a, ops.sigmoid(b))


@register_function(F.hardshrink, torch.hardshrink)
@register_method("hardshrink")
def hardshrink(input, lambd=0.5):
    return ops.where(ops.gt(ops.abs(input), lambd), input, 0.0)


@register_function(F.softshrink)
def softshrink(input, lambd=0.5):
    shrunk = ops.sub(input, ops.mul(ops.sign(input), lambd))
    return ops.where(ops.gt(ops.abs(input), lambd), shrunk, 0.0)


@register_function(F.tanhshrink)
def tanhshrink(input):
    return ops.sub(input, ops.tanh(input))


@register_function(F.softmin)
def softmin(input, dim=None, _stacklevel=3, dtype=None):
    return ops.softmax(ops.neg(input), dim, dtype)


@register_function(F.threshold, torch.threshold)
def threshold(input, threshold, value, inplace=False):
    return ops.where(ops.gt(input, threshold), input, value)


@register_function(F.prelu, torch.prelu)
def prelu(input, weight):
    """x where x >= 0, else weight * x; a weight per channel (dim 1) broadcasts over the rest."""
    if weight.numel() > 1 and input.ndim >= 2:
        weight = ops.reshape(weight, (weight.numel(),) + (1,) * (input.ndim - 2))
    return ops.where(ops.ge(input, 0), input, ops.mul(weight, input))


@register_function(F.rrelu, check=lambda input, lower=1 / 8, upper=1 / 3, training=False, inplace=False:
                   not training)
def rrelu(input, lower=1 / 8, upper=1 / 3, training=False, inplace=False):
    """In inference, leaky_relu with the mean slope (lower + upper) / 2."""
    return ops.leaky_relu(input, (lower + upper) / 2)


@register_module(nn.PReLU)
class PReLU(KilnModule):
    def __call__(self, x):
        return prelu(x, self.param("weight"))


@register_module(nn.GLU)
class GLU(KilnModule):
    def __call__(self, x):
        return glu(x, self.torch_module.dim)


@register_module(nn.Softmin)
class Softmin(KilnModule):
    def __call__(self, x):
        return softmin(x, self.torch_module.dim)
