"""View-like functions and their copying variants (the *_copy functions give the same values),
splits, selections, the scatters into views (diagonal/select/slice_scatter), Tensor.unfold,
take, fill and the reflected operator methods (__radd__, ...)."""
import math

import torch

from kiln import ops
from kiln.frontend.torch import register_function, register_method
from kiln.tensor import asarray

from kiln_mappings_builtin.arrange import diagonal_of
from kiln_mappings_builtin.common import dims_arg, is_tensor
from kiln_mappings_builtin.shape import narrow, t, unbind


@register_function(torch.expand_copy)
def expand_copy(input, size, *, implicit=False):
    return ops.expand(input, tuple(size))


@register_function(torch.view_copy, check=lambda input, size: not isinstance(size, torch.dtype))
def view_copy(input, size):
    return ops.reshape(input, tuple(size))


@register_function(torch.permute_copy)
def permute_copy(input, dims):
    return ops.permute(input, tuple(dims))


@register_function(torch.transpose_copy)
def transpose_copy(input, dim0, dim1):
    return ops.transpose(input, dim0, dim1) if input.ndim else input


@register_function(torch.t_copy)
def t_copy(input):
    return t(input)


@register_function(torch.squeeze_copy)
def squeeze_copy(input, dim=None):
    return ops.squeeze(input) if dim is None else ops.squeeze(input, dim)


@register_function(torch.unsqueeze_copy)
def unsqueeze_copy(input, dim):
    return ops.unsqueeze(input, dim)


@register_function(torch.alias_copy, torch.detach_copy)
def alias_copy(input):
    return input


@register_function(torch.diagonal_copy)
def diagonal_copy(input, offset=0, dim1=0, dim2=1):
    return diagonal_of(input, offset, dim1, dim2)


@register_function(torch.narrow_copy, check=lambda input, dim, start, length: not is_tensor(start))
@register_method("narrow_copy", check=lambda input, dim, start, length: not is_tensor(start))
def narrow_copy(input, dim, start, length):
    return narrow(input, dim, start, length)


@register_function(torch.unbind_copy)
def unbind_copy(input, dim=0):
    return unbind(input, dim)


def _pieces(result) -> tuple:
    return result if isinstance(result, tuple) else (result,)


@register_function(torch.split_with_sizes, torch.split_with_sizes_copy, torch.unsafe_split_with_sizes)
@register_method("split_with_sizes")
def split_with_sizes(input, split_sizes, dim=0):
    return _pieces(ops.split(input, list(split_sizes), dim))


@register_function(torch.unsafe_split)
@register_method("unsafe_split")
def unsafe_split(input, split_size, dim=0):
    return _pieces(ops.split(input, split_size, dim))


@register_function(torch.unsafe_chunk)
@register_method("unsafe_chunk")
def unsafe_chunk(input, chunks, dim=0):
    return _pieces(ops.chunk(input, chunks, dim))


def split_at(input, indices_or_sections, dim=0):
    """Into `n` near-equal pieces (the first size % n one longer), or at the listed indices."""
    d = dim % input.ndim
    size = input.shape[d]
    if isinstance(indices_or_sections, int):
        n = indices_or_sections
        bounds = [k * (size // n) + min(k, size % n) for k in range(n + 1)]
    else:
        bounds = [0] + [min(max(i if i >= 0 else i + size, 0), size) for i in indices_or_sections] + [size]
    return tuple(ops.slice(input, d, lo, max(lo, hi)) for lo, hi in zip(bounds, bounds[1:]))


def _directional_split(dim_of):
    def rule(input, indices_or_sections):
        return split_at(input, indices_or_sections, dim_of(input))
    return rule


hsplit = register_function(torch.hsplit)(register_method("hsplit")(
    _directional_split(lambda t: 0 if t.ndim == 1 else 1)))
vsplit = register_function(torch.vsplit)(register_method("vsplit")(_directional_split(lambda t: 0)))
dsplit = register_function(torch.dsplit)(register_method("dsplit")(_directional_split(lambda t: 2)))


@register_function(torch.select)
@register_method("select")
def select(input, dim, index):
    i = index % input.shape[dim]
    return ops.squeeze(ops.slice(input, dim, i, i + 1), dim)


@register_function(torch.ravel)
@register_method("ravel")
def ravel(input):
    return ops.reshape(input, (-1,))


@register_method("sum_to_size")
def sum_to_size(self, *size):
    size = dims_arg(size)
    lead = self.ndim - len(size)
    dims = list(range(lead)) + [lead + k for k, s in enumerate(size) if s == 1 and self.shape[lead + k] != 1]
    total = ops.sum(self, dims, True) if dims else self
    return ops.reshape(total, size)


@register_function(torch.take)
@register_method("take")
def take(input, index):
    flat = ops.reshape(input, (-1,))
    n = max(flat.shape[0], 1)
    positions = ops.where(ops.lt(index, 0), ops.add(index, n), index)
    return ops.reshape(ops.index_select(flat, 0, ops.reshape(positions, (-1,))), index.shape)


@register_function(torch.fill, check=lambda input, value: not is_tensor(value) or value.ndim == 0)
def fill(input, value):
    if is_tensor(value):
        return ops.cast(ops.broadcast_to(value, input.shape), input.dtype)
    return ops.full(input.shape, value, dtype=input.dtype, device=input.device)


@register_function(torch.zero_)
def zero_(input):
    return ops.full(input.shape, 0, dtype=input.dtype, device=input.device)


def _reflected(op: str):
    def rule(self, other):
        return getattr(ops, op)(other, self)
    rule.__name__ = rule.__qualname__ = f"reflected_{op}"
    return rule


for _method, _op in {"__radd__": "add", "__rmul__": "mul", "__rdiv__": "div", "__rtruediv__": "div",
                     "__rmod__": "remainder", "__rpow__": "pow", "__rmatmul__": "matmul",
                     "__rfloordiv__": "floor_divide", "__rand__": "bitwise_and", "__ror__": "bitwise_or",
                     "__rxor__": "bitwise_xor"}.items():
    register_method(_method)(_reflected(_op))


# ---------------------------------------------------------------- scatters into views

def _positions(shape, view) -> torch.Tensor:
    """The flat positions, in a tensor of `shape`, of the elements of `view(arange)`."""
    return view(torch.arange(math.prod(shape)).reshape(shape))


def _scatter_into_view(input, src, view):
    """input with the elements that `view` (a function of a torch tensor) selects replaced by src."""
    where = _positions(tuple(input.shape), view)
    mask = torch.zeros(math.prod(input.shape), dtype=torch.bool)
    mask[where.reshape(-1)] = True
    order = torch.zeros(math.prod(input.shape), dtype=torch.int64)
    order[where.reshape(-1)] = torch.arange(where.numel())
    flat_src = ops.reshape(ops.broadcast_to(ops.cast(src, input.dtype), tuple(where.shape)), (-1,))
    device = input.device
    placed = ops.reshape(ops.index_select(flat_src, 0, asarray(order, device=device)), input.shape) \
        if where.numel() else input
    return ops.where(asarray(mask.reshape(tuple(input.shape)), device=device), placed, input)


@register_function(torch.diagonal_scatter)
@register_method("diagonal_scatter")
def diagonal_scatter(input, src, offset=0, dim1=0, dim2=1):
    return _scatter_into_view(input, src, lambda t: torch.diagonal(t, offset, dim1, dim2))


@register_function(torch.select_scatter)
@register_method("select_scatter")
def select_scatter(input, src, dim, index):
    return _scatter_into_view(input, src, lambda t: torch.select(t, dim, index))


@register_function(torch.slice_scatter)
@register_method("slice_scatter")
def slice_scatter(input, src, dim=0, start=None, end=None, step=1):
    return _scatter_into_view(input, src, lambda t: torch.slice_copy(t, dim, start, end, step))


@register_method("unfold")
def unfold(self, dimension, size, step):
    """The windows of `size` elements every `step` along `dimension`, as a new last dim."""
    d = dimension % max(self.ndim, 1)
    if self.ndim == 0:
        return ops.reshape(self, (1,))
    n = (self.shape[d] - size) // step + 1
    index = torch.arange(n)[:, None] * step + torch.arange(size)[None, :]
    picked = ops.index_select(self, d, asarray(index.reshape(-1), device=self.device))
    shape = tuple(self.shape[:d]) + (n, size) + tuple(self.shape[d + 1:])
    return ops.permute(ops.reshape(picked, shape), [k for k in range(len(shape)) if k != d + 1] + [d + 1])


@register_function(torch.unfold_copy)
def unfold_copy(input, dimension, size, step):
    return unfold(input, dimension, size, step)


@register_function(torch.constant_pad_nd)
def constant_pad_nd(input, pad, value=0):
    return ops.pad(input, list(pad), "constant", value)


@register_function(torch.narrow, priority=1, check=lambda input, dim, start, length: is_tensor(start))
@register_method("narrow", priority=1, check=lambda input, dim, start, length: is_tensor(start))
def narrow_at_tensor(input, dim, start, length):
    """narrow with a 0-d tensor start: the positions start .. start + length - 1 gathered."""
    d = dim % input.ndim
    begin = ops.where(ops.lt(start, 0), ops.add(start, input.shape[d]), start)
    positions = ops.add(ops.arange(length, device=input.device), ops.cast(begin, torch.int64))
    return ops.index_select(input, d, positions)


def _gather_edge(input, dim, index, *, sparse_grad=False, out=None) -> bool:
    return index.numel() == 0 or input.ndim == 0 or index.dtype not in (torch.int64, torch.int32)


@register_function(torch.gather, priority=1, check=_gather_edge)
@register_method("gather", priority=1, check=_gather_edge)
def gather_edge(input, dim, index, *, sparse_grad=False, out=None):
    """gather's edge cases: an empty index, a 0-d input (its index holds zeros), a narrow index type."""
    if index.numel() == 0:
        return ops.full(index.shape, 0, dtype=input.dtype, device=input.device)
    if input.ndim == 0:
        return ops.broadcast_to(input, index.shape)
    return ops.gather(input, dim, ops.cast(index, torch.int64))


@register_function(torch.transpose, torch.swapaxes, torch.swapdims, priority=1,
                   check=lambda input, dim0, dim1: input.ndim == 0)
@register_method("transpose", "swapaxes", "swapdims", priority=1, check=lambda input, dim0, dim1: input.ndim == 0)
def transpose_0d(input, dim0, dim1):
    return input


def _tensor_repeats(input, repeats=None, dim=None, *, output_size=None) -> bool:
    return is_tensor(repeats) and output_size is not None


@register_function(torch.repeat_interleave, priority=1, check=_tensor_repeats)
@register_method("repeat_interleave", priority=1, check=_tensor_repeats)
def repeat_interleave_counted(input, repeats, dim=None, *, output_size=None):
    """Per-element repeats with a known output_size: output j takes the element whose running
    total of repeats first exceeds j."""
    if dim is None:
        input, dim = ops.reshape(input, (-1,)), 0
    ends = ops.cumsum(ops.broadcast_to(repeats, (input.shape[dim],)), 0)
    j = ops.reshape(ops.arange(output_size, device=input.device), (output_size, 1))
    source = ops.sum(ops.le(ends, j), 1)
    return ops.index_select(input, dim, ops.clamp(source, max=input.shape[dim] - 1))


@register_function(torch.take_along_dim, priority=1)
@register_method("take_along_dim", priority=1)
def take_along_dim_wrapping(input, indices, dim=None, *, out=None):
    """take_along_dim with negative indices counted from the end, as PyTorch allows."""
    if dim is None:
        input, dim = ops.reshape(input, (-1,)), 0
        indices = ops.reshape(indices, (-1,))
    size = input.shape[dim] if input.ndim else 1
    indices = ops.where(ops.lt(indices, 0), ops.add(indices, size), indices)
    return ops.take_along_dim(input, indices, dim)
