"""Rearranging and constructing tensors, composed from shape operators: rot90, fliplr/flipud,
pixel_shuffle/unshuffle, channel_shuffle, atleast_*d, hstack/vstack/dstack/column_stack,
block_diag, cartesian_prod, meshgrid, diag/diagonal/diag_embed/diagflat, eye, linspace,
logspace, tril/triu_indices, unflatten, F.unfold (im2col) and F.fold (col2im, the operator `fold`),
and the in-place fills zero_/fill_/copy_ (and set_ of a like tensor).

Creation functions without tensor arguments (eye, linspace, the triangle indices) build their
values in PyTorch at trace time and enter the graph as constants.
"""
import functools
import math

import torch
import torch.nn.functional as F

from kiln import ops
from kiln.frontend.torch import register_function, register_method
from kiln.tensor import asarray

from kiln_mappings_builtin.common import is_tensor


@register_function(torch.rot90)
@register_method("rot90")
def rot90(input, k=1, dims=(0, 1)):
    d0, d1 = dims
    k %= 4
    if k == 0:
        return input
    if k == 2:
        return ops.flip(input, [d0, d1])
    return ops.transpose(ops.flip(input, [d1 if k == 1 else d0]), d0, d1)


@register_function(torch.fliplr)
@register_method("fliplr")
def fliplr(input):
    return ops.flip(input, [1])


@register_function(torch.flipud)
@register_method("flipud")
def flipud(input):
    return ops.flip(input, [0])


@register_function(F.pixel_shuffle, torch.pixel_shuffle)
def pixel_shuffle(input, upscale_factor):
    """(*, C r^2, H, W) -> (*, C, H r, W r)."""
    r = upscale_factor
    *lead, c, h, w = input.shape
    x = ops.reshape(input, tuple(lead) + (c // (r * r), r, r, h, w))
    n = len(lead)
    x = ops.permute(x, list(range(n)) + [n, n + 3, n + 1, n + 4, n + 2])
    return ops.reshape(x, tuple(lead) + (c // (r * r), h * r, w * r))


@register_function(F.pixel_unshuffle, torch.pixel_unshuffle)
def pixel_unshuffle(input, downscale_factor):
    """(*, C, H r, W r) -> (*, C r^2, H, W)."""
    r = downscale_factor
    *lead, c, h, w = input.shape
    n = len(lead)
    x = ops.reshape(input, tuple(lead) + (c, h // r, r, w // r, r))
    x = ops.permute(x, list(range(n)) + [n, n + 2, n + 4, n + 1, n + 3])
    return ops.reshape(x, tuple(lead) + (c * r * r, h // r, w // r))


@register_function(F.channel_shuffle, torch.channel_shuffle, torch.native_channel_shuffle)
def channel_shuffle(input, groups):
    n, c, *rest = input.shape
    x = ops.reshape(input, (n, groups, c // groups, *rest))
    return ops.reshape(ops.transpose(x, 1, 2), tuple(input.shape))


def _at_least(rank: int):
    def lift(t):
        if t.ndim >= rank:
            return t
        if t.ndim == 0:
            return ops.reshape(t, (1,) * rank)
        if rank == 3:  # (n,) -> (1, n, 1); (m, n) -> (m, n, 1)
            return ops.reshape(t, (1, t.shape[0], 1) if t.ndim == 1 else tuple(t.shape) + (1,))
        return ops.reshape(t, (1,) * (rank - t.ndim) + tuple(t.shape))

    def rule(*tensors):
        if len(tensors) == 1 and isinstance(tensors[0], (list, tuple)):
            return tuple(lift(t) for t in tensors[0])
        return lift(tensors[0]) if len(tensors) == 1 else tuple(lift(t) for t in tensors)
    rule.__name__ = rule.__qualname__ = f"atleast_{rank}d"
    return rule


atleast_1d = register_function(torch.atleast_1d)(_at_least(1))
atleast_2d = register_function(torch.atleast_2d)(_at_least(2))
atleast_3d = register_function(torch.atleast_3d)(_at_least(3))


@register_function(torch.hstack)
def hstack(tensors, *, out=None):
    tensors = atleast_1d(list(tensors))
    return ops.cat(list(tensors), 0 if tensors[0].ndim == 1 else 1)


@register_function(torch.vstack, torch.row_stack)
def vstack(tensors, *, out=None):
    return ops.cat(list(atleast_2d(list(tensors))), 0)


@register_function(torch.dstack)
def dstack(tensors, *, out=None):
    return ops.cat(list(atleast_3d(list(tensors))), 2)


@register_function(torch.column_stack)
def column_stack(tensors, *, out=None):
    columns = [ops.reshape(t, (t.numel(), 1)) if t.ndim <= 1 else t for t in tensors]
    return ops.cat(columns, 1)


@register_function(torch.block_diag)
def block_diag(*tensors):
    blocks = [ops.reshape(t, (1, 1)) if t.ndim == 0 else ops.unsqueeze(t, 0) if t.ndim == 1 else t
              for t in tensors]
    width = sum(b.shape[1] for b in blocks)
    dtype = functools.reduce(torch.promote_types, [b.dtype.torch_dtype for b in blocks])
    rows, left = [], 0
    for b in blocks:
        rows.append(ops.pad(ops.cast(b, dtype), [left, width - left - b.shape[1]]))
        left += b.shape[1]
    return ops.cat(rows, 0)


@register_function(torch.meshgrid)
def meshgrid(*tensors, indexing=None):
    if len(tensors) == 1 and isinstance(tensors[0], (list, tuple)):
        tensors = tuple(tensors[0])
    xy = indexing == "xy" and len(tensors) >= 2
    order = list(tensors)
    if xy:
        order[0], order[1] = order[1], order[0]
    shape = tuple(t.numel() for t in order)
    grids = []
    for k, t in enumerate(order):
        view = [1] * len(order)
        view[k] = shape[k]
        grids.append(ops.broadcast_to(ops.reshape(t, tuple(view)), shape))
    if xy:
        grids[0], grids[1] = grids[1], grids[0]
    return tuple(grids)


@register_function(torch.cartesian_prod)
def cartesian_prod(*tensors):
    if len(tensors) == 1:
        return tensors[0]
    grids = meshgrid(*tensors, indexing="ij")
    return ops.stack([ops.reshape(g, (-1,)) for g in grids], 1)


# ---------------------------------------------------------------- diagonals

def _diagonal_positions(n1: int, n2: int, offset: int) -> list[int]:
    """Flat positions, in an (n1, n2) matrix, of its diagonal `offset`."""
    start = (0, offset) if offset >= 0 else (-offset, 0)
    length = max(0, min(n1 - start[0], n2 - start[1]))
    return [(start[0] + k) * n2 + start[1] + k for k in range(length)]


@register_function(torch.diagonal)
@register_method("diagonal")
def diagonal_of(input, offset=0, dim1=0, dim2=1):
    """The diagonal `offset` of the matrices over dims (dim1, dim2), as the last dim."""
    d1, d2 = dim1 % input.ndim, dim2 % input.ndim
    rest = [d for d in range(input.ndim) if d not in (d1, d2)]
    x = ops.permute(input, rest + [d1, d2])
    n1, n2 = input.shape[d1], input.shape[d2]
    flat = ops.reshape(x, tuple(input.shape[d] for d in rest) + (n1 * n2,))
    positions = asarray(torch.tensor(_diagonal_positions(n1, n2, offset), dtype=torch.int64),
                        device=input.device)
    return ops.index_select(flat, len(rest), positions)


def _embedded(values, offset: int):
    """(.., n) -> (.., m, m), m = n + |offset|, with `values` on diagonal `offset`, zeros elsewhere."""
    n = values.shape[-1]
    m = n + abs(offset)
    mask = torch.zeros(m, m, dtype=torch.bool)
    mask.view(-1)[_diagonal_positions(m, m, offset)] = True
    padded = ops.pad(values, [0, abs(offset)])
    # offset >= 0: row i holds v[i] (out[i, i + k] = v[i]); otherwise column j holds v[j]
    spread = ops.unsqueeze(padded, -1) if offset >= 0 else ops.unsqueeze(padded, -2)
    zero = ops.full((), 0, dtype=values.dtype, device=values.device)
    return ops.where(asarray(mask, device=values.device), spread, zero)


@register_function(torch.diag_embed)
@register_method("diag_embed")
def diag_embed(input, offset=0, dim1=-2, dim2=-1):
    out = _embedded(input, offset)
    d1, d2 = dim1 % out.ndim, dim2 % out.ndim
    if (d1, d2) == (out.ndim - 2, out.ndim - 1):
        return out
    rest = iter(range(out.ndim - 2))
    order = [out.ndim - 2 if k == d1 else out.ndim - 1 if k == d2 else next(rest) for k in range(out.ndim)]
    return ops.permute(out, order)


@register_function(torch.diag, check=lambda input, diagonal=0, **k: input.ndim in (1, 2))
@register_method("diag", check=lambda input, diagonal=0, **k: input.ndim in (1, 2))
def diag(input, diagonal=0, *, out=None):
    return _embedded(input, diagonal) if input.ndim == 1 else diagonal_of(input, diagonal)


@register_function(torch.diagflat)
@register_method("diagflat")
def diagflat(input, offset=0):
    return _embedded(ops.reshape(input, (-1,)), offset)


# ---------------------------------------------------------------- constants and fills

def _constant(t: torch.Tensor, device):
    return asarray(t, device=device or "cpu")


@register_function(torch.eye)
def eye(n, m=None, *, dtype=None, layout=None, device=None, pin_memory=False, requires_grad=False, out=None):
    return _constant(torch.eye(n, n if m is None else m, dtype=dtype), device)


def _plain_bounds(start, end, steps, *args, **kwargs) -> bool:
    return not is_tensor(start) and not is_tensor(end)


@register_function(torch.linspace, check=_plain_bounds)
def linspace(start, end, steps, *, dtype=None, layout=None, device=None, pin_memory=False,
             requires_grad=False, out=None):
    return _constant(torch.linspace(start, end, steps, dtype=dtype), device)


@register_function(torch.logspace, check=_plain_bounds)
def logspace(start, end, steps, base=10.0, *, dtype=None, layout=None, device=None, pin_memory=False,
             requires_grad=False, out=None):
    return _constant(torch.logspace(start, end, steps, base, dtype=dtype), device)


@register_function(torch.tril_indices)
def tril_indices(row, col, offset=0, *, dtype=torch.int64, device=None, layout=None, pin_memory=False):
    return _constant(torch.tril_indices(row, col, offset, dtype=dtype), device)


@register_function(torch.triu_indices)
def triu_indices(row, col, offset=0, *, dtype=torch.int64, device=None, layout=None, pin_memory=False):
    return _constant(torch.triu_indices(row, col, offset, dtype=dtype), device)


@register_function(torch.unflatten)
@register_method("unflatten")
def unflatten(input, dim, sizes):
    d = dim % input.ndim
    sizes = list(sizes)
    if -1 in sizes:
        known = math.prod(s for s in sizes if s != -1)
        sizes[sizes.index(-1)] = input.shape[d] // known
    return ops.reshape(input, tuple(input.shape[:d]) + tuple(sizes) + tuple(input.shape[d + 1:]))


@register_method("zero_")
def zero_(self):
    return ops.full(self.shape, 0, dtype=self.dtype, device=self.device)


@register_method("fill_", check=lambda self, value: not is_tensor(value) or value.ndim == 0)
def fill_(self, value):
    if is_tensor(value):
        return ops.cast(ops.broadcast_to(value, self.shape), self.dtype)
    return ops.full(self.shape, value, dtype=self.dtype, device=self.device)


def _same_kind(self, source=None, *args, **kwargs) -> bool:
    return (is_tensor(source) and not args and not kwargs and tuple(source.shape) == tuple(self.shape)
            and source.dtype == self.dtype and source.device == self.device)


@register_function(torch.Tensor.set_, check=_same_kind)
@register_method("set_", check=_same_kind)
def set_(self, source):
    """`x.set_(y)` where y has x's shape, dtype and device: x's values become y's (dynamo's
    `p.data = y`, which `module.to(dtype)` in a forward writes for each parameter). Another
    shape or dtype would change x's own metadata, which is not mapped."""
    return source


@register_method("copy_", check=lambda self, src, non_blocking=False: is_tensor(src)
                 and src.device.torch().type == self.device.torch().type)
def copy_(self, src, non_blocking=False):
    return ops.cast(ops.broadcast_to(src, self.shape), self.dtype)



def _tensor_bounds(start, end, steps, *args, **kwargs) -> bool:
    return is_tensor(start) or is_tensor(end)


def _spaced(start, end, steps: int, dtype, device):
    """PyTorch's linspace: from start for the first half, back from end for the second."""
    dtype = dtype or torch.get_default_dtype()
    start = ops.cast(start, dtype) if is_tensor(start) else ops.full((), start, dtype=dtype, device=device)
    end = ops.cast(end, dtype) if is_tensor(end) else ops.full((), end, dtype=dtype, device=device)
    if steps <= 1:
        return ops.reshape(start, (steps,)) if steps == 1 else ops.full((0,), 0, dtype=dtype, device=device)
    step = ops.div(ops.sub(end, start), steps - 1)
    i = ops.arange(steps, dtype=dtype, device=device)
    forward = ops.add(start, ops.mul(step, i))
    backward = ops.sub(end, ops.mul(step, ops.sub(steps - 1, i)))
    return ops.where(ops.lt(i, steps // 2), forward, backward)


@register_function(torch.linspace, check=_tensor_bounds)
def linspace_of_tensors(start, end, steps, *, dtype=None, layout=None, device=None, pin_memory=False,
                        requires_grad=False, out=None):
    return _spaced(start, end, steps, dtype, device)


@register_function(torch.logspace, check=_tensor_bounds)
def logspace_of_tensors(start, end, steps, base=10.0, *, dtype=None, layout=None, device=None,
                        pin_memory=False, requires_grad=False, out=None):
    exponents = _spaced(start, end, steps, torch.float64, device)
    return ops.cast(ops.pow(float(base), exponents), dtype or torch.get_default_dtype())


def _pair(v):
    return (v, v) if isinstance(v, int) else tuple(v)


@register_function(F.unfold)
def im2col(input, kernel_size, dilation=1, padding=0, stride=1):
    """F.unfold: the sliding (kh, kw) blocks of a (N, C, H, W) input as columns (N, C*kh*kw, L)."""
    (kh, kw), (dh, dw), (ph, pw), (sh, sw) = map(_pair, (kernel_size, dilation, padding, stride))
    batched = input.ndim == 4
    x = input if batched else ops.unsqueeze(input, 0)
    x = ops.pad(x, [pw, pw, ph, ph]) if ph or pw else x
    n, c, h, w = x.shape
    oh, ow = (h - dh * (kh - 1) - 1) // sh + 1, (w - dw * (kw - 1) - 1) // sw + 1
    blocks = [ops.slice(ops.slice(x, 2, i * dh, i * dh + (oh - 1) * sh + 1, sh), 3, j * dw,
                        j * dw + (ow - 1) * sw + 1, sw) for i in range(kh) for j in range(kw)]
    cols = ops.reshape(ops.stack(blocks, 2), (n, c * kh * kw, oh * ow))
    return cols if batched else ops.squeeze(cols, 0)


@register_function(F.fold)
def col2im(input, output_size, kernel_size, dilation=1, padding=0, stride=1):
    """F.fold: the columns (N, C*kh*kw, L) of unfold back to (N, C, H, W), overlapping entries summed."""
    return ops.fold(input, output_size, kernel_size, dilation, padding, stride)
