"""ATen reductions: sums, products, means, extremes, logical reductions and variance, over dim lists
(an empty list meaning every dim, as in ATen); sort and topk; histc (the torch-level rule's)."""
from kiln import ops
from kiln.frontend.torch import register_function
from kiln_mappings_builtin import statistics

from kiln_mappings_aten.common import aten, all_dims


@register_function(aten.sum.dim_IntList)
def sum_(x, dim, keepdim=False, dtype=None):
    return ops.sum(x, all_dims(dim), keepdim, dtype)


@register_function(aten.sum.default)
def sum_all(x, dtype=None):
    return ops.sum(x, None, False, dtype)


@register_function(aten.prod.dim_int)
def prod(x, dim, keepdim=False, dtype=None):
    return ops.prod(x, dim, keepdim, dtype)


@register_function(aten.prod.default)
def prod_all(x, dtype=None):
    return ops.prod(x, None, False, dtype)


@register_function(aten.cumsum.default)
def cumsum(x, dim, dtype=None):
    return ops.cumsum(x, dim, dtype)


@register_function(aten.mean.dim)
def mean(x, dim, keepdim=False, dtype=None):
    return ops.mean(x, all_dims(dim), keepdim, dtype)


@register_function(aten.mean.default)
def mean_all(x, dtype=None):
    return ops.mean(x, None, False, dtype)


def _extreme(op: str):
    def rule(x, dim=(), keepdim=False):
        return getattr(ops, op)(x, all_dims(dim), keepdim)
    rule.__name__ = rule.__qualname__ = op
    return rule


amax = register_function(aten.amax.default)(_extreme("amax"))
amin = register_function(aten.amin.default)(_extreme("amin"))


@register_function(aten.max.dim)
def max_dim(x, dim, keepdim=False):
    return tuple(ops.max_dim(x, dim, keepdim))


@register_function(aten.min.dim)
def min_dim(x, dim, keepdim=False):
    return tuple(ops.min_dim(x, dim, keepdim))


@register_function(aten.max.default)
def max_all(x):
    return ops.amax(x)


@register_function(aten.min.default)
def min_all(x):
    return ops.amin(x)


@register_function(aten.argmax.default)
def argmax(x, dim=None, keepdim=False):
    return ops.argmax(x, dim, keepdim)


@register_function(aten.any.default, aten.any.dim, aten.any.dims)
def any_(x, dim=None, keepdim=False):
    return ops.any(x, all_dims(dim), keepdim)


@register_function(aten.all.default, aten.all.dim, aten.all.dims)
def all_(x, dim=None, keepdim=False):
    return ops.all(x, all_dims(dim), keepdim)


def _correction(correction) -> float:
    return 1 if correction is None else correction


@register_function(aten.var.correction)
def var(x, dim=None, correction=None, keepdim=False):
    return ops.var(x, all_dims(dim), _correction(correction), keepdim)


@register_function(aten.var_mean.correction)
def var_mean(x, dim=None, correction=None, keepdim=False):
    dims = all_dims(dim)
    return ops.var(x, dims, _correction(correction), keepdim), ops.mean(x, dims, keepdim)


@register_function(aten.linalg_vector_norm.default)
def vector_norm(x, ord=2, dim=None, keepdim=False, dtype=None):
    """The `ord`-norm over `dim` (every dim without it): max or min of |x| for +-inf, the count
    of non-zeros for 0, else (sum |x|^ord)^(1/ord)."""
    if dtype is not None:
        x = ops.cast(x, dtype)
    dims = all_dims(dim)
    size = ops.abs(x)
    if ord == float("inf"):
        return ops.amax(size, dims, keepdim)
    if ord == float("-inf"):
        return ops.amin(size, dims, keepdim)
    if ord == 0:
        return ops.sum(ops.cast(ops.ne(x, 0), x.dtype), dims, keepdim)
    if ord == 1:
        return ops.sum(size, dims, keepdim)
    if ord == 2:
        return ops.sqrt(ops.sum(ops.mul(x, x), dims, keepdim))
    return ops.pow(ops.sum(ops.pow(size, ord), dims, keepdim), 1.0 / ord)


@register_function(aten.sort.default)
def sort(x, dim=-1, descending=False):
    """A stable sort, valid for unstable requests too."""
    return ops.sort(x, dim, descending)


@register_function(aten.sort.stable)
def sort_stable(x, stable=None, dim=-1, descending=False):
    return ops.sort(x, dim, descending)


@register_function(aten.topk.default)
def topk(x, k, dim=-1, largest=True, sorted=True):
    """The k largest (smallest) in order, which `sorted=False` allows too."""
    return ops.topk(x, k, dim, largest)


@register_function(aten.histc.default, check=statistics.histc_supported)
def histc(x, bins=100, min=0, max=0):
    return statistics.histc(x, bins, min, max)
