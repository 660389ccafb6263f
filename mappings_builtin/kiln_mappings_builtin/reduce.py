"""Reductions: torch functions and Tensor methods (sum, mean, max with its overloads, ...)."""
import torch

from kiln import ops
from kiln.frontend.torch import register_function, register_method

from kiln_mappings_builtin.common import direct, is_tensor

for _name in ("sum", "mean", "prod", "amax", "amin", "argmax", "argmin", "all", "any",
              "cumsum", "softmax", "log_softmax"):
    direct(_name, [getattr(torch, _name)], [_name])


def _extreme(op: str, binary: str):
    def rule(input, dim=None, keepdim=False, *, out=None):
        if is_tensor(dim):
            return getattr(ops, binary)(input, dim)
        if dim is None:
            return getattr(ops, op)(input)
        return getattr(ops, f"{op}_dim")(input, dim, keepdim)
    rule.__name__ = rule.__qualname__ = op
    return rule


register_function(torch.max)(register_method("max")(_extreme("max", "maximum")))
register_function(torch.min)(register_method("min")(_extreme("min", "minimum")))


def _spread(op: str):
    def rule(input, dim=None, unbiased=None, keepdim=False, *, correction=None):
        if isinstance(dim, bool):  # var(x, unbiased)
            dim, unbiased = None, dim
        if correction is None:
            correction = 1 if unbiased is None else int(unbiased)
        return getattr(ops, op)(input, dim, correction=correction, keepdim=keepdim)
    rule.__name__ = rule.__qualname__ = op
    return rule


var = register_function(torch.var)(register_method("var")(_spread("var")))
std = register_function(torch.std)(register_method("std")(_spread("std")))


@register_function(torch.var_mean)
def var_mean(input, dim=None, unbiased=None, keepdim=False, *, correction=None):
    spread = var(input, dim, unbiased, keepdim, correction=correction)
    return spread, ops.mean(input, None if isinstance(dim, bool) else dim, keepdim)


@register_function(torch.std_mean)
def std_mean(input, dim=None, unbiased=None, keepdim=False, *, correction=None):
    spread, mean = var_mean(input, dim, unbiased, keepdim, correction=correction)
    return ops.sqrt(spread), mean


def _vector_norm_p(input, p=2, *args, **kwargs) -> bool:
    return p != "nuc"


@register_function(torch.norm, check=_vector_norm_p)
@register_method("norm", check=_vector_norm_p)
def vector_norm(input, p=2, dim=None, keepdim=False, dtype=None):
    """The p-norm over `dim` (all dims if None): inf and -inf give the largest and smallest
    magnitude, 0 counts nonzeros, 'fro' is the 2-norm."""
    magnitude = ops.abs(input)
    if p == float("inf"):
        return ops.amax(magnitude, dim, keepdim)
    if p == float("-inf"):
        return ops.amin(magnitude, dim, keepdim)
    if p == 0:
        return ops.sum(ops.cast(ops.ne(input, 0), input.dtype), dim, keepdim)
    p = 2 if p == "fro" else p
    return ops.pow(ops.sum(ops.pow(magnitude, p), dim, keepdim), 1 / p)


@register_function(torch.linalg.vector_norm)
def linalg_vector_norm(x, ord=2, dim=None, keepdim=False, *, dtype=None, out=None):
    return vector_norm(x, ord, dim, keepdim)
