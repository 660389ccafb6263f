"""torch.masked reductions and normalizations on plain tensors with a bool `mask`: masked-out
elements take the operation's identity (0 for sums, 1 for products, -inf/+inf for extremes and
softmax, so fully masked rows give NaN), as torch.masked defines them. Signal windows (torch.signal.windows), which take no
tensors, are built in PyTorch at trace time and enter the graph as constants."""
import torch

from kiln import ops
from kiln.frontend.torch import register_function
from kiln.tensor import asarray

from kiln_mappings_builtin.common import is_tensor


def _filled(input, mask, identity):
    if mask is None:
        return input
    return ops.where(ops.broadcast_to(mask, input.shape), input, identity)


def _dims(input, dim):
    if dim is None or dim == () or dim == []:
        return list(range(input.ndim))
    return [dim] if isinstance(dim, int) else list(dim)


def _reduction(op: str, identity):
    def rule(input, dim=None, *, keepdim=False, dtype=None, mask=None):
        x = input if dtype is None else ops.cast(input, dtype)
        filled = _filled(x, mask, identity)
        dims = _dims(x, dim)
        return getattr(ops, op)(filled, dims, keepdim)
    rule.__name__ = rule.__qualname__ = f"masked_{op}"
    return rule


masked_sum = register_function(torch.masked.sum)(_reduction("sum", 0))
masked_prod = register_function(torch.masked.prod)(_reduction("prod", 1))
masked_amax = register_function(torch.masked.amax)(_reduction("amax", float("-inf")))
masked_amin = register_function(torch.masked.amin)(_reduction("amin", float("inf")))


@register_function(torch.masked.mean)
def masked_mean(input, dim=None, *, keepdim=False, dtype=None, mask=None):
    x = input if dtype is None else ops.cast(input, dtype)
    dims = _dims(x, dim)
    if mask is None:
        return ops.mean(x, dims, keepdim)
    count = ops.sum(ops.broadcast_to(mask, x.shape), dims, keepdim)
    return ops.div(ops.sum(_filled(x, mask, 0), dims, keepdim), count)


def _scan(op: str, identity):
    def rule(input, dim, *, dtype=None, mask=None):
        x = input if dtype is None else ops.cast(input, dtype)
        return getattr(ops, op)(_filled(x, mask, identity), dim)
    rule.__name__ = rule.__qualname__ = f"masked_{op}"
    return rule


masked_cumsum = register_function(torch.masked.cumsum)(_scan("cumsum", 0))
masked_cumprod = register_function(torch.masked.cumprod)(_scan("cumprod", 1))


def _normalized(op: str, negate: bool = False):
    def rule(input, dim, *, dtype=None, mask=None):
        x = input if dtype is None else ops.cast(input, dtype)
        x = ops.neg(x) if negate else x
        return getattr(ops, op)(_filled(x, mask, float("-inf")), dim)
    rule.__name__ = rule.__qualname__ = f"masked_{op}{'_neg' if negate else ''}"
    return rule


masked_softmax = register_function(torch.masked.softmax)(_normalized("softmax"))
masked_log_softmax = register_function(torch.masked.log_softmax)(_normalized("log_softmax"))
masked_softmin = register_function(torch.masked.softmin)(_normalized("softmax", negate=True))


def _no_tensors(*args, **kwargs) -> bool:
    return not any(is_tensor(a) for a in list(args) + list(kwargs.values()))


def _window(function):
    def rule(*args, device=None, **kwargs):
        return asarray(function(*args, **kwargs), device=device or "cpu")
    rule.__name__ = rule.__qualname__ = f"window_{function.__name__}"
    return rule


for _name in ("hamming", "hann", "bartlett", "blackman", "cosine", "exponential", "gaussian", "kaiser",
              "general_cosine", "general_hamming", "nuttall"):
    _function = getattr(torch.signal.windows, _name)
    register_function(_function, check=_no_tensors)(_window(_function))
for _function in (torch.hann_window, torch.hamming_window, torch.blackman_window, torch.bartlett_window,
                  torch.kaiser_window):
    register_function(_function, check=_no_tensors)(_window(_function))
