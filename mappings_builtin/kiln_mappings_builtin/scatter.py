"""Scatter functions and methods: scatter (with a value, or reduce='add'/'multiply'),
scatter_add, scatter_reduce, index_add, index_copy, index_fill, index_put and masked_scatter
(the operators of kiln_ops_builtin.scatter); in-place forms rebind through the interpreter."""
import torch

from kiln import ops
from kiln.frontend.torch import register_function, register_method

from kiln_mappings_builtin.common import is_tensor, no_out

_LEGACY_REDUCE = {"add": "sum", "multiply": "prod"}


@register_function(torch.scatter, check=no_out)
@register_method("scatter")
def scatter(input, dim, index, src=None, value=None, *, reduce=None, out=None):
    src = value if src is None else src
    if reduce is not None:
        if not is_tensor(src):
            src = ops.full(index.shape, src, dtype=input.dtype, device=input.device)
        return ops.scatter_reduce(input, dim, index, src, _LEGACY_REDUCE.get(reduce, reduce))
    return ops.scatter(input, dim, index, ops.cast(src, input.dtype) if is_tensor(src) else src)


@register_function(torch.scatter_add, check=no_out)
@register_method("scatter_add")
def scatter_add(input, dim, index, src, *, out=None):
    return ops.scatter_add(input, dim, index, src)


@register_function(torch.scatter_reduce, check=no_out)
@register_method("scatter_reduce")
def scatter_reduce(input, dim, index, src, reduce, *, include_self=True, out=None):
    return ops.scatter_reduce(input, dim, index, src, reduce, include_self)


@register_function(torch.index_add, check=no_out)
@register_method("index_add")
def index_add(input, dim, index, source, *, alpha=1, out=None):
    return ops.index_add(input, dim, index, source, alpha)


@register_function(torch.index_copy, check=no_out)
@register_method("index_copy")
def index_copy(input, dim, index, source, *, out=None):
    return ops.index_copy(input, dim, index, source)


@register_function(torch.index_fill)
@register_method("index_fill")
def index_fill(input, dim, index, value):
    return ops.index_fill(input, dim, index, value)


def _integer_indices(input, indices, values, accumulate=False) -> bool:
    return all(is_tensor(i) and not i.dtype.is_bool for i in indices)


@register_function(torch.index_put, check=_integer_indices)
@register_method("index_put", check=_integer_indices)
def index_put(input, indices, values, accumulate=False):
    values = ops.cast(values, input.dtype) if is_tensor(values) else values
    return ops.index_put(input, list(indices), values, accumulate)


@register_function(torch.masked_scatter)
@register_method("masked_scatter")
def masked_scatter(input, mask, source):
    shape = torch.broadcast_shapes(tuple(input.shape), tuple(mask.shape))
    return ops.masked_scatter(ops.broadcast_to(input, shape), mask, source)


@register_function(torch.index_reduce)
@register_method("index_reduce")
def index_reduce(input, dim, index, source, reduce, *, include_self=True):
    return ops.index_reduce(input, dim, index, source, reduce, include_self)
