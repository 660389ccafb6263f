"""ATen view and layout operators: views become Kiln's reshapes, permutes and slices (values, not
aliases), and the scatter forms of slicing write a slice back by concatenation; diagonals and
strided views read and write the elements of a storage through Kiln's as_strided and
as_strided_scatter (index arithmetic, no gather), the storage laid out as PyTorch traced it."""
import math
import operator

import torch

from kiln import dtypes, ops
from kiln.frontend.torch import register_function, traced_argument

from kiln_mappings_aten.common import aten, same_signature

same_signature("reshape", aten.view.default, aten._unsafe_view.default, aten.reshape.default)
same_signature("permute", aten.permute.default)
same_signature("unsqueeze", aten.unsqueeze.default)
same_signature("squeeze", aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims)
same_signature("transpose", aten.transpose.int)
same_signature("cat", aten.cat.default)
same_signature("flip", aten.flip.default)
same_signature("roll", aten.roll.default)
same_signature("repeat", aten.repeat.default)


def _of_sequence(value, index) -> bool:
    return isinstance(value, (tuple, list))


@register_function(operator.getitem, priority=1, check=_of_sequence)
def item(value, index):
    """An element of a multi-output operator's result (ATen graphs read them by getitem)."""
    return value[index]


@register_function(aten.expand.default)
def expand(x, size, implicit=False):
    return ops.expand(x, list(size))


@register_function(aten.t.default)
def t(x):
    return x if x.ndim < 2 else ops.transpose(x, 0, 1)


def _bounds(size: int, start, end) -> tuple[int, int]:
    """A slice's start and end, negative ones counted from the end, clamped to 0 <= start <=
    end <= size as ATen clamps them."""
    start = 0 if start is None else (start + size if start < 0 else start)
    end = size if end is None else (end + size if end < 0 else end)
    start = min(max(start, 0), size)
    return start, min(max(end, start), size)


@register_function(aten.slice.Tensor)
def slice_(x, dim=0, start=None, end=None, step=1):
    start, end = _bounds(x.shape[dim], start, end)
    return ops.slice(x, dim, start, end, step)


@register_function(aten.select.int)
def select(x, dim, index):
    index %= x.shape[dim]
    return ops.squeeze(ops.slice(x, dim, index, index + 1), dim)


@register_function(aten.split.Tensor, aten.split_with_sizes.default)
def split(x, split_size, dim=0):
    pieces = ops.split(x, split_size, dim)
    return list(pieces) if isinstance(pieces, tuple) else [pieces]   # one piece: one tensor


@register_function(aten.constant_pad_nd.default)
def constant_pad_nd(x, pad, value=0):
    return ops.pad(x, list(pad), "constant", value)


def _written(x, src, dim: int, start: int, end: int):
    """`x` with positions [start, end) of `dim` replaced by `src`."""
    parts = [ops.slice(x, dim, 0, start)] if start > 0 else []
    parts.append(src)
    if end < x.shape[dim]:
        parts.append(ops.slice(x, dim, end, x.shape[dim]))
    return parts[0] if len(parts) == 1 else ops.cat(parts, dim)


@register_function(aten.slice_scatter.default)
def slice_scatter(x, src, dim=0, start=None, end=None, step=1):
    """`x` with `src` written over `x[..., start:end:step]` along `dim`."""
    dim %= x.ndim
    start, end = _bounds(x.shape[dim], start, end)
    src = ops.cast(src, x.dtype)
    if step == 1:
        return _written(x, src, dim, start, end)
    positions = ops.arange(start, end, step, dtype=dtypes.int64, device=x.device)
    return ops.index_copy(x, dim, positions, src)


@register_function(aten.select_scatter.default)
def select_scatter(x, src, dim, index):
    dim %= x.ndim
    index %= x.shape[dim]
    return _written(x, ops.cast(ops.unsqueeze(src, dim), x.dtype), dim, index, index + 1)


def _static(x, *args, **kwargs) -> bool:
    return all(isinstance(n, int) for n in x.shape)


def _view_of(x, view) -> tuple:
    """(size, stride, storage offset) of the view that `view` (a function from a torch tensor to
    a view of it) takes of a contiguous tensor of `x`'s shape."""
    viewed = view(torch.empty(x.shape, device="meta"))
    return tuple(viewed.shape), viewed.stride(), viewed.storage_offset()


@register_function(aten.diagonal.default, check=_static)
def diagonal(x, offset=0, dim1=0, dim2=1):
    return ops.as_strided(x, *_view_of(x, lambda t: t.diagonal(offset, dim1, dim2)))


@register_function(aten.diagonal_scatter.default, check=_static)
def diagonal_scatter(x, src, offset=0, dim1=0, dim2=1):
    """`x` with `src` written over its diagonal `offset` of dims (dim1, dim2)."""
    return ops.as_strided_scatter(x, ops.cast(src, x.dtype),
                                  *_view_of(x, lambda t: t.diagonal(offset, dim1, dim2)))


def _storage_order(x) -> tuple[list[int], int]:
    """The dims of `x` (the node's first argument) from the largest stride PyTorch traced it with
    to the smallest, and its traced storage offset: permuted so, `x`'s row-major order is its
    storage's. Raises where the traced layout is unknown or does not fill the storage densely
    (gaps between elements, or elements sharing memory), which Kiln's values cannot show."""
    traced = traced_argument(0)
    if traced is None:
        raise ValueError("the strides PyTorch traced the input with are unknown (no metadata)")
    strides, base = traced.stride(), traced.storage_offset()
    order = sorted(range(x.ndim), key=lambda d: (-strides[d] if x.shape[d] > 1 else 0, d))
    dense = 1
    for d in reversed(order):
        if x.shape[d] > 1 and strides[d] != dense and math.prod(x.shape):
            raise ValueError(f"the input was traced as {x.dtype} {list(x.shape)} with strides "
                             f"{list(strides)} at storage offset {base}, which does not fill its "
                             "storage densely (gaps or shared elements): Kiln holds tensors as "
                             "values, not memory, and reads a storage only through a dense tensor")
        dense *= x.shape[d]
    return order, base


@register_function(aten.as_strided.default, check=_static)
def as_strided(x, size, stride, storage_offset=None):
    """The strided view of `x`'s storage, laid out as PyTorch traced `x` (its strides and storage
    offset: a channels_last tensor's storage holds channels innermost)."""
    order, base = _storage_order(x)
    start = base if storage_offset is None else storage_offset
    return ops.as_strided(ops.permute(x, order), size, stride, start - base)


@register_function(aten.as_strided_scatter.default, check=_static)
def as_strided_scatter(x, src, size, stride, storage_offset=None):
    """`x` with `src` written over the strided view `as_strided` reads."""
    order, base = _storage_order(x)
    start = base if storage_offset is None else storage_offset
    written = ops.as_strided_scatter(ops.permute(x, order), ops.cast(src, x.dtype), size, stride,
                                     start - base)
    return ops.permute(written, [order.index(d) for d in range(x.ndim)])
