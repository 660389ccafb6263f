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
        mask = items[0]
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


def _index_tensor(item) -> bool:
    return is_tensor(item) and item.dtype.is_integer or \
        isinstance(item, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in item)


def _index_tensors_and_full_slices(x, index, value) -> bool:
    """`x[rows, cols] = v`, `x[:, idx] = v`: integer index tensors (or lists of ints) where every
    other item is a full slice or Ellipsis; v a number or a tensor of x's kind."""
    if not is_tensor(x) or not any(_index_tensor(i) for i in _items(index)):
        return False
    if is_tensor(value) and value.dtype.is_float and not x.dtype.is_float:
        return False
    items = _expand_ellipsis(_items(index), x.ndim)
    return len(items) <= x.ndim and all(_index_tensor(i) or isinstance(i, slice) and i == slice(None) for i in items)


@register_function(operator.setitem, check=_index_tensors_and_full_slices)
@register_method("__setitem__", check=_index_tensors_and_full_slices)
def setitem_index_tensors(x, index, value):
    """x with `value` written where the index tensors point (index_put without accumulate), the
    indexed dims moved first and back; the value broadcast to the region eager's x[index] has."""
    items = _expand_ellipsis(_items(index), x.ndim)
    items += [slice(None)] * (x.ndim - len(items))
    dims = [d for d, i in enumerate(items) if not isinstance(i, slice)]
    indices = [asarray(i, "int64", x.device) if isinstance(i, list) else i for i in items if not isinstance(i, slice)]
    index_shape = tuple(torch.broadcast_shapes(*(tuple(i.shape) for i in indices)))
    rest = [d for d in range(x.ndim) if d not in dims]
    order = dims + rest
    adjacent = dims == list(range(dims[0], dims[0] + len(dims)))
    if is_tensor(value):
        value = ops.cast(value, x.dtype)
        if adjacent and dims[0] > 0:      # eager's region: x.shape[:p] + index_shape + the rest
            before = [x.shape[d] for d in range(dims[0])]
            region = tuple(before) + index_shape + tuple(x.shape[d] for d in rest[dims[0]:])
            value = ops.broadcast_to(value, region)
            n, p = len(index_shape), dims[0]
            value = ops.permute(value, list(range(p, p + n)) + list(range(p)) + list(range(p + n, len(region))))
    moved = x if order == list(range(x.ndim)) else ops.permute(x, order)
    written = ops.index_put(moved, indices, value, False)
    return written if moved is x else ops.permute(written, [order.index(d) for d in range(x.ndim)])
