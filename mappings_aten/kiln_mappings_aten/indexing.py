"""ATen gathers and scatters: index with index tensors, index_put (with accumulate: the backward
of indexing and of embeddings), gather, scatter, index_select, index_add, embedding."""
import math

import torch

from kiln import dtypes, ops
from kiln.frontend.torch import register_function
from kiln_mappings_builtin import scatter

from kiln_mappings_aten.common import aten, same_signature

same_signature("gather", aten.gather.default)
same_signature("index_select", aten.index_select.default)
same_signature("scatter_add", aten.scatter_add.default)
same_signature("scatter", aten.scatter.src, aten.scatter.value)
same_signature("scatter_reduce", aten.scatter_reduce.two)
same_signature("index_add", aten.index_add.default)


@register_function(aten.embedding.default)
def embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    return ops.embedding(indices, weight)


def _adjacent(indices) -> bool:
    """Whether the index tensors (not None) are one run of positions: their result dims then
    take the place of the indexed dims, where one reshape and one gather produce them."""
    used = [k for k, t in enumerate(indices) if t is not None]
    return bool(used) and used == list(range(used[0], used[-1] + 1))


def _index_checked(x, indices) -> bool:
    return _adjacent(indices)


@register_function(aten.index.Tensor, check=_index_checked)
def index(x, indices):
    """`x[..., i, j, ...]` for index tensors on adjacent dims: the indexed dims merged into one,
    gathered by the broadcast flat index."""
    used = [k for k, t in enumerate(indices) if t is not None]
    first, last = used[0], used[-1] + 1
    sizes = x.shape[first:last]
    flat = None
    for k in used:
        stride = math.prod(sizes[k - first + 1:])
        term = ops.mul(ops.remainder(ops.add(indices[k], x.shape[k]), x.shape[k]), stride)
        flat = term if flat is None else ops.add(flat, term)
    merged = ops.reshape(x, x.shape[:first] + (math.prod(sizes),) + x.shape[last:])
    picked = ops.index_select(merged, first, ops.reshape(flat, (-1,)))
    return ops.reshape(picked, x.shape[:first] + flat.shape + x.shape[last:])


def _index_put_checked(x, indices, values, accumulate=False) -> bool:
    return _adjacent(indices) and not _one_mask(indices)


def _one_mask(indices) -> bool:
    return len(indices) == 1 and indices[0] is not None and indices[0].dtype == dtypes.boolean


def _masked_fill_checked(x, indices, values, accumulate=False) -> bool:
    return _one_mask(indices) and values.numel() == 1


@register_function(aten.index_put.default, check=_masked_fill_checked)
def masked_put(x, indices, values, accumulate=False):
    """`x[mask] = value` (`+=` with accumulate) for one bool mask over x's leading dims and a
    single value (Longformer's `x[mask] = -10000.0`, functionalized): a select by the mask."""
    mask = indices[0]
    mask = ops.reshape(mask, tuple(mask.shape) + (1,) * (x.ndim - mask.ndim))
    value = ops.cast(ops.reshape(values, ()), x.dtype)
    return ops.where(mask, ops.add(x, value) if accumulate else value, x)


def _masked_rows_checked(x, indices, values, accumulate=False) -> bool:
    return _one_mask(indices) and values.numel() != 1


@register_function(aten.index_put.default, check=_masked_rows_checked)
def masked_put_rows(x, indices, values, accumulate=False):
    """`x[mask] = values` with one value or row per selected position, or none (VITS): the
    torch-level rule, which checks that the mask selects as many."""
    return scatter.index_put_mask(x, indices, values, accumulate)


@register_function(aten.index_put.default, check=_index_put_checked)
def index_put(x, indices, values, accumulate=False):
    """`x` with `values` written (or added) at the positions of index tensors on adjacent dims:
    those dims are moved to the front for Kiln's index_put (which indexes leading dims), and
    back."""
    used = [k for k, t in enumerate(indices) if t is not None]
    first, count = used[0], len(used)
    values = ops.cast(values, x.dtype)
    if first == 0:
        return ops.index_put(x, [indices[k] for k in used], values, accumulate)
    index_shape = _broadcast(indices, used)
    index_ndim = len(index_shape)
    target = x.shape[:first] + index_shape + x.shape[first + count:]
    values = ops.expand(ops.reshape(values, (1,) * (len(target) - values.ndim) + values.shape),
                        list(target))
    front = list(range(first, first + count)) + list(range(first)) + list(range(first + count, x.ndim))
    values_front = (list(range(first, first + index_ndim)) + list(range(first)) +
                    list(range(first + index_ndim, len(target))))
    written = ops.index_put(ops.permute(x, front), [indices[k] for k in used],
                            ops.permute(values, values_front), accumulate)
    return ops.permute(written, [front.index(d) for d in range(x.ndim)])


def _broadcast(indices, used) -> tuple:
    """The shape the index tensors broadcast to."""
    shape = ()
    for k in used:
        shape = tuple(torch.broadcast_shapes(shape, indices[k].shape))
    return shape
