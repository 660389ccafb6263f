"""ATen view and layout operators: views become Kiln's reshapes, permutes and slices (values, not
aliases), and the scatter forms of slicing write a slice back by concatenation; diagonals and
strided views gather and scatter by the flat positions they select."""
import math
import operator

import torch

from kiln import dtypes, ops
from kiln.frontend.torch import register_function
from kiln.tensor import asarray

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
    return list(ops.split(x, split_size, dim))


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


def _positions(x, view) -> torch.Tensor:
    """The flat positions, in contiguous `x`, of the elements that `view` (a function from a
    torch tensor to a view of it) selects."""
    return view(torch.arange(math.prod(x.shape)).reshape(x.shape)).contiguous()


def _gathered(x, positions: torch.Tensor):
    """The elements of `x` at flat `positions`, in their shape."""
    flat = ops.index_select(ops.reshape(x, (-1,)), 0,
                            asarray(positions.reshape(-1), device=x.device))
    return ops.reshape(flat, tuple(positions.shape))


def _scattered(x, positions: torch.Tensor, src):
    """`x` with `src` written at flat `positions`."""
    values = ops.broadcast_to(ops.cast(src, x.dtype), tuple(positions.shape))
    flat = ops.index_put(ops.reshape(x, (-1,)), [asarray(positions.reshape(-1), device=x.device)],
                         ops.reshape(values, (-1,)))
    return ops.reshape(flat, x.shape)


@register_function(aten.diagonal.default, check=_static)
def diagonal(x, offset=0, dim1=0, dim2=1):
    return _gathered(x, _positions(x, lambda t: t.diagonal(offset, dim1, dim2)))


@register_function(aten.diagonal_scatter.default, check=_static)
def diagonal_scatter(x, src, offset=0, dim1=0, dim2=1):
    """`x` with `src` written over its diagonal `offset` of dims (dim1, dim2)."""
    return _scattered(x, _positions(x, lambda t: t.diagonal(offset, dim1, dim2)), src)


@register_function(aten.as_strided.default, check=_static)
def as_strided(x, size, stride, storage_offset=None):
    """The strided view of `x`'s elements, `x` taken as contiguous from its first element:
    AOTAutograd's graphs take it of fresh tensors, and Kiln's values have no strides (of a
    strided or offset input, the input's own layout is not seen)."""
    return _gathered(x, _positions(x, lambda t: t.as_strided(size, stride, storage_offset)))


@register_function(aten.as_strided_scatter.default, check=_static)
def as_strided_scatter(x, src, size, stride, storage_offset=None):
    """`x` with `src` written over the strided view `as_strided` reads."""
    return _scattered(x, _positions(x, lambda t: t.as_strided(size, stride, storage_offset)), src)
