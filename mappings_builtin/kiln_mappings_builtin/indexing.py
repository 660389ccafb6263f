"""`x[index]` and `x[index] = value` with ints, slices, None, Ellipsis and index tensors
(`x[rows, cols] = v`: the operator index_put)."""
import math
import operator

import torch

from kiln import dtypes, ops
from kiln.frontend.torch import register_function, register_method
from kiln.tensor import asarray, from_torch

from kiln_mappings_builtin.common import is_tensor


def _items(index) -> list:
    return list(index) if isinstance(index, tuple) else [index]


def _is_mask(item) -> bool:
    return is_tensor(item) and item.dtype == dtypes.boolean


def _expand_ellipsis(items: list, ndim: int) -> list:
    used = sum(1 for i in items if i is not None and i is not Ellipsis)
    for k, item in enumerate(items):
        if item is Ellipsis:
            return items[:k] + [slice(None)] * (ndim - used) + items[k + 1:]
    return items


def _no_mask_index(x, index) -> bool:
    return not any(_is_mask(i) for i in _items(index))


@register_function(operator.getitem, check=_no_mask_index)
@register_method("__getitem__", check=_no_mask_index)
def getitem(x, index):
    """Basic indexing (ints select, as in PyTorch, not NumPy) narrows and reshapes; index
    tensors and lists gather, their result dims placed as PyTorch places them."""
    if not is_tensor(x):
        return x[index]
    items = _items(index)
    items = [asarray(i, "int64", x.device) if isinstance(i, list) else i for i in items]
    dim, advanced = 0, []
    for item in _expand_ellipsis(items, x.ndim):
        if item is None:
            x = ops.unsqueeze(x, dim)
            dim += 1
        elif isinstance(item, int):
            i = item % x.shape[dim]
            x = ops.squeeze(ops.slice(x, dim, i, i + 1), dim)
        elif isinstance(item, slice):
            if item != slice(None):
                x = ops.slice(x, dim, item.start, item.stop, item.step or 1)
            dim += 1
        else:
            advanced.append((dim, item))
            dim += 1
    return _gather(x, advanced) if advanced else x


def _gather(x, advanced):
    """Advanced indexing by index tensors at dims `advanced` [(dim, tensor), ...]."""
    dims = [d for d, _ in advanced]
    if dims != list(range(dims[0], dims[0] + len(dims))):  # apart: result dims go first
        x = ops.permute(x, dims + [d for d in range(x.ndim) if d not in dims])
        dims = list(range(len(dims)))
    flat = None
    for d, (source_dim, index) in zip(dims, advanced):
        index = ops.wrap_index(index, x.shape[d], source_dim)   # negatives wrap, out of range raises
        flat = index if flat is None else ops.add(ops.mul(flat, x.shape[d]), index)
    shape, first, last = x.shape, dims[0], dims[-1]
    index_shape = tuple(torch.broadcast_shapes(*(t.shape for _, t in advanced)))
    flat = ops.reshape(ops.broadcast_to(flat, index_shape), (-1,))
    merged = ops.reshape(x, shape[:first] + (math.prod(shape[first:last + 1]),) + shape[last + 1:])
    picked = ops.index_select(merged, first, flat)
    return ops.reshape(picked, shape[:first] + index_shape + shape[last + 1:])


def _setitem_supported(x, index, value) -> bool:
    items = _items(index)
    if len(items) == 1 and _is_mask(items[0]):
        return not is_tensor(value) or value.numel() == 1
    return not any(is_tensor(i) for i in items)


@register_function(operator.setitem, check=_setitem_supported)
@register_method("__setitem__", check=_setitem_supported)
def setitem(x, index, value):
    """The tensor with `value` written at `index` (basic indexing, or one bool mask with a
    single value); the interpreter rebinds `x` to it."""
    items = _items(index)
    if _is_mask(items[0]):
        mask = ops.reshape(items[0], tuple(items[0].shape) + (1,) * (x.ndim - items[0].ndim))  # x's leading dims
    else:
        region = tuple(torch.empty(x.shape, device="meta")[index].shape)
        where = torch.zeros(x.shape, dtype=torch.bool)
        where[index] = True
        mask = from_torch(where.to(x.device.torch()))
        if is_tensor(value):
            positions = torch.zeros(x.shape, dtype=torch.int64)
            positions[index] = torch.arange(math.prod(region)).reshape(region)
            flat = ops.reshape(ops.broadcast_to(value, region), (-1,))
            picked = ops.index_select(flat, 0, from_torch(positions.reshape(-1).to(x.device.torch())))
            value = ops.reshape(picked, x.shape)
    if is_tensor(value):
        value = ops.cast(value, x.dtype)
    return ops.cast(ops.where(mask, value, x), x.dtype)


def _index_tensors(x, index, value) -> bool:
    items = _items(index)
    return any(is_tensor(i) for i in items) and not any(_is_mask(i) for i in items)


@register_function(operator.setitem, check=_index_tensors)
@register_method("__setitem__", check=_index_tensors)
def setitem_indexed(x, index, value):
    """`x[index] = value` where `index` holds index tensors: the same indexing of the flat
    positions of `x` says which elements index_put writes."""
    positions = ops.reshape(ops.arange(x.numel(), device=x.device), x.shape)
    targets = getitem(positions, index)
    if is_tensor(value):
        value = ops.reshape(ops.broadcast_to(ops.cast(value, x.dtype), targets.shape), (-1,))
    flat = ops.index_put(ops.reshape(x, (-1,)), [ops.reshape(targets, (-1,))], value)
    return ops.reshape(flat, x.shape)
