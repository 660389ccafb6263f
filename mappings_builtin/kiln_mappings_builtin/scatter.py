"""Scatter functions and methods: scatter (with a value, or reduce='add'/'multiply'),
scatter_add, scatter_reduce, index_add, index_copy, index_fill, index_put and masked_scatter
(the operators of kiln_ops_builtin.scatter); in-place forms rebind through the interpreter."""
import operator

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


def _one_mask(input, indices, values, accumulate=False) -> bool:
    return len(indices) == 1 and is_tensor(indices[0]) and indices[0].dtype.is_bool


@register_function(torch.index_put, check=_one_mask)
@register_method("index_put", check=_one_mask)
def index_put_mask(input, indices, values, accumulate=False):
    """x[mask] = values (or +=): one value (or row) for every selected position, or one per
    selected position in row-major order; the kernel checks that the mask selects as many as
    there are (none for empty `values`), failing where eager raises."""
    selects = indices[0]
    rest = input.ndim - selects.ndim
    mask = ops.broadcast_to(ops.reshape(selects, tuple(selects.shape) + (1,) * rest), input.shape)
    values = ops.cast(values, input.dtype) if is_tensor(values) else values
    base = ops.full(input.shape, 0, dtype=input.dtype, device=input.device) if accumulate else input
    if not is_tensor(values) or values.ndim <= rest or values.shape[0] == 1:
        if is_tensor(values) and values.ndim > rest:
            values = ops.reshape(values, tuple(values.shape[1:]))
        placed = ops.where(mask, values, base)
    else:
        result = "".join(f", {n}" for n in input.shape[selects.ndim:])
        placed = ops.checked_count(ops.masked_scatter(base, mask, values), ops.sum(selects), values.shape[0],
                                   f"index_put (x[mask] = values): shape mismatch: value tensor of shape "
                                   f"{list(values.shape)} cannot be broadcast to indexing result of shape "
                                   f"[{{value}}{result}]")
    return ops.add(input, placed) if accumulate else ops.cast(placed, input.dtype)


def _mask_with_values(x, index, value) -> bool:
    return is_tensor(index) and index.dtype.is_bool and is_tensor(value) and value.numel() != 1


@register_function(operator.setitem, priority=1, check=_mask_with_values)
@register_method("__setitem__", priority=1, check=_mask_with_values)
def setitem_mask(x, index, value):
    """x[mask] = values with several values, or none (VITS: then the mask must select nothing):
    index_put with the mask."""
    return index_put_mask(x, [index], value)
