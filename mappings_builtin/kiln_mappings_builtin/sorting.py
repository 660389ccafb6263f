"""Order statistics: sort, argsort, msort, topk, kthvalue, median, nanmedian and mode (the
rank-counting operators of kiln_ops_builtin.sorting)."""
import torch

from kiln import ops
from kiln.frontend.torch import register_function, register_method

from kiln_mappings_builtin.common import no_out


@register_function(torch.sort, check=no_out)
@register_method("sort")
def sort(input, dim=-1, descending=False, stable=False, *, out=None):
    """A stable sort: for unstable requests too, since any order of equal elements is valid."""
    if isinstance(dim, bool):  # sort(x, stable) overload: sort(input, *, stable, dim, descending)
        dim = -1
    return ops.sort(input, dim, descending)


@register_function(torch.argsort, check=no_out)
@register_method("argsort")
def argsort(input, dim=-1, descending=False, stable=False, *, out=None):
    return ops.argsort(input, dim, descending)


@register_function(torch.msort)
@register_method("msort")
def msort(input, *, out=None):
    return ops.sort(input, 0)[0]


def _sorted_topk(input, k, dim=-1, largest=True, sorted=True, *, out=None) -> bool:
    return out is None


@register_function(torch.topk, check=_sorted_topk)
@register_method("topk")
def topk(input, k, dim=-1, largest=True, sorted=True, *, out=None):
    """The k largest (smallest) in order; `sorted=False` leaves the order free, so sorted is valid."""
    return ops.topk(input, k, dim, largest)


@register_function(torch.kthvalue, check=no_out)
@register_method("kthvalue")
def kthvalue(input, k, dim=-1, keepdim=False, *, out=None):
    return ops.kthvalue(input, k, dim, keepdim)


def _order_statistic(op: str):
    def rule(input, dim=None, keepdim=False, *, out=None):
        if dim is None:
            value, _ = getattr(ops, op)(ops.reshape(input, (-1,)), 0)
            return value
        return getattr(ops, op)(input, dim, keepdim)
    rule.__name__ = rule.__qualname__ = op
    return rule


median = register_function(torch.median, check=no_out)(register_method("median")(_order_statistic("median")))
nanmedian = register_function(torch.nanmedian, check=no_out)(
    register_method("nanmedian")(_order_statistic("nanmedian")))


@register_function(torch.mode, check=no_out)
@register_method("mode")
def mode(input, dim=-1, keepdim=False, *, out=None):
    return ops.mode(input, dim, keepdim)
