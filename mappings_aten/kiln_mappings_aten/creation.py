"""ATen creation operators (full, arange, the *_like family, scalar tensors) and random numbers
(`seeded_uniform` and `seeded_normal`, what the backend makes of aten.rand(_like) and
aten.randn(_like))."""
import torch

from kiln import ops
from kiln.frontend.torch import register_function
from kiln.frontend.torch.random import seeded_normal, seeded_uniform

from kiln_mappings_aten.common import aten


@register_function(aten.full.default)
def full(size, fill_value, dtype=None, layout=None, device=None, pin_memory=None):
    return ops.full(tuple(size), fill_value, dtype=dtype, device=device)


def _filled(value):
    def rule(size, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
        return ops.full(tuple(size), value, dtype=dtype or torch.get_default_dtype(), device=device)
    return rule


zeros = register_function(aten.zeros.default)(_filled(0))
ones = register_function(aten.ones.default)(_filled(1))
empty = register_function(aten.empty.memory_format)(_filled(0))   # any value will do: zeros


@register_function(aten.empty_permuted.default)
def empty_permuted(size, physical_layout, dtype=None, layout=None, device=None, pin_memory=None):
    """Zeros, as `empty`: Kiln's values have no memory layout to permute."""
    return empty(size, dtype, layout, device, pin_memory)


@register_function(aten.empty_strided.default)
def empty_strided(size, stride, dtype=None, layout=None, device=None, pin_memory=None):
    """Zeros, as `empty`: Kiln's values have no strides."""
    return empty(size, dtype, layout, device, pin_memory)


@register_function(aten.new_empty_strided.default)
def new_empty_strided(x, size, stride, dtype=None, layout=None, device=None, pin_memory=None):
    """Zeros of `x`'s dtype and device (unless given), as `empty_strided`."""
    return ops.full(tuple(size), 0, dtype=dtype or x.dtype, device=device or x.device)


@register_function(aten.scalar_tensor.default)
def scalar_tensor(value, dtype=None, layout=None, device=None, pin_memory=None):
    return ops.full((), value, dtype=dtype or torch.get_default_dtype(), device=device)


def _like(value):
    def rule(x, *fill, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
        return ops.full(x.shape, fill[0] if fill else value, dtype=dtype or x.dtype,
                        device=device or x.device)
    return rule


full_like = register_function(aten.full_like.default)(_like(None))
zeros_like = register_function(aten.zeros_like.default)(_like(0))
ones_like = register_function(aten.ones_like.default)(_like(1))
empty_like = register_function(aten.empty_like.default)(_like(0))


@register_function(aten.arange.default)
def arange(end, dtype=None, layout=None, device=None, pin_memory=None):
    return ops.arange(end, dtype=dtype, device=device)


@register_function(aten.arange.start, aten.arange.start_step)
def arange_from(start, end, step=1, dtype=None, layout=None, device=None, pin_memory=None):
    return ops.arange(start, end, step, dtype=dtype, device=device)


def _random(op: str):
    def rule(seeds, row, size_or_like, dtype=None):
        """Kiln's counter-based generator keyed by `seeds[row]`."""
        like = not isinstance(size_or_like, (list, tuple))
        size = size_or_like.shape if like else size_or_like
        if dtype is None:
            dtype = size_or_like.dtype if like else torch.get_default_dtype()
        return getattr(ops, op)(seeds, row, tuple(size), dtype)
    return rule


uniform = register_function(seeded_uniform)(_random("random_uniform"))
normal = register_function(seeded_normal)(_random("random_normal"))
