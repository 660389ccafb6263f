"""Shape functions and methods: views, permutations, joins and splits, triangles, gathers."""
import torch

from kiln import ops
from kiln.frontend.torch import register_function, register_method

from kiln_mappings_builtin.common import dims_arg, direct

for _name in ("flatten", "squeeze", "unsqueeze", "transpose", "broadcast_to", "flip", "roll",
              "tile", "tril", "triu", "gather", "index_select", "take_along_dim"):
    direct(_name, [getattr(torch, _name)], [_name])
direct("cat", [torch.cat, torch.concat, torch.concatenate])
direct("stack", [torch.stack])
direct("transpose", [torch.swapaxes, torch.swapdims], ["swapaxes", "swapdims"])


@register_function(torch.reshape)
@register_method("reshape", "view", check=lambda self, *shape: not any(
    isinstance(s, (torch.dtype, str)) for s in shape))
def reshape(input, *shape):
    return ops.reshape(input, dims_arg(shape))


@register_method("view_as", "reshape_as")
def view_as(self, other):
    return ops.reshape(self, other.shape)


@register_function(torch.permute)
@register_method("permute")
def permute(input, *dims):
    return ops.permute(input, dims_arg(dims))


@register_function(torch.t)
@register_method("t")
def t(input):
    return ops.transpose(input, 0, 1) if input.ndim == 2 else input


@register_function(torch.movedim, torch.moveaxis)
@register_method("movedim", "moveaxis")
def movedim(input, source, destination):
    src = [source] if isinstance(source, int) else list(source)
    dst = [destination] if isinstance(destination, int) else list(destination)
    src, dst = [s % input.ndim for s in src], [d % input.ndim for d in dst]
    rest = iter([d for d in range(input.ndim) if d not in src])
    order = {d: s for s, d in zip(src, dst)}
    return ops.permute(input, [order[k] if k in order else next(rest) for k in range(input.ndim)])


@register_method("expand")
def expand(self, *sizes):
    return ops.expand(self, dims_arg(sizes))


@register_method("expand_as")
def expand_as(self, other):
    return ops.expand(self, other.shape)


@register_function(torch.broadcast_tensors)
def broadcast_tensors(*tensors):
    shape = torch.broadcast_shapes(*(t.shape for t in tensors))
    return tuple(ops.broadcast_to(t, shape) for t in tensors)


@register_method("repeat")
def repeat(self, *sizes):
    return ops.repeat(self, dims_arg(sizes))


def _pieces(result) -> tuple:
    """A multi-output operator gives one tensor when it has one piece; torch gives a tuple."""
    return result if isinstance(result, tuple) else (result,)


@register_function(torch.split)
@register_method("split")
def split(tensor, split_size_or_sections, dim=0):
    return _pieces(ops.split(tensor, split_size_or_sections, dim))


@register_function(torch.chunk)
@register_method("chunk")
def chunk(input, chunks, dim=0):
    return _pieces(ops.chunk(input, chunks, dim))


@register_function(torch.unbind)
@register_method("unbind")
def unbind(input, dim=0):
    return tuple(ops.squeeze(p, dim) for p in _pieces(ops.split(input, 1, dim)))


@register_function(torch.narrow)
@register_method("narrow")
def narrow(input, dim, start, length):
    start = start % input.shape[dim] if start < 0 else start
    return ops.slice(input, dim, start, start + length)


def _int_repeats(input, repeats=None, dim=None, **kwargs) -> bool:
    return isinstance(repeats, int)


@register_function(torch.repeat_interleave, check=_int_repeats)
@register_method("repeat_interleave", check=_int_repeats)
def repeat_interleave(input, repeats, dim=None, *, output_size=None):
    """Each element repeated `repeats` times along `dim` (of the flattened input if None)."""
    if dim is None:
        input, dim = ops.reshape(input, (-1,)), 0
    d = dim % input.ndim
    shape = list(input.shape)
    expanded = ops.expand(ops.unsqueeze(input, d + 1), shape[:d + 1] + [repeats] + shape[d + 1:])
    return ops.reshape(expanded, shape[:d] + [shape[d] * repeats] + shape[d + 1:])


@register_method("contiguous", "clone", "detach", "requires_grad_")
@register_function(torch.clone, torch.detach)
def identity(input, *args, **kwargs):
    return input
