"""Creation functions: arange, full, zeros, ones, the *_like functions, the new_* methods
(new_tensor too) and torch.tensor."""
import torch

from kiln import dtypes, ops
from kiln.device import device as as_device
from kiln.frontend.torch import register_function, register_method
from kiln.tensor import asarray

from kiln_mappings_builtin.common import dims_arg, is_tensor


@register_function(torch.arange)
def arange(start, end=None, step=1, *, dtype=None, device=None, layout=None, requires_grad=False,
           pin_memory=False, out=None):
    return ops.arange(start, end, step, dtype=dtype, device=device)


def _filled(value):
    def rule(*dims, size=None, dtype=None, device=None, layout=None, requires_grad=False, pin_memory=False,
             memory_format=None, out=None):
        shape = dims_arg(dims) if size is None else tuple(size)      # torch.ones(2, 3), or size=(2, 3)
        return ops.full(shape, value, dtype=dtype or torch.get_default_dtype(), device=device)
    return rule


zeros = register_function(torch.zeros)(_filled(0))
ones = register_function(torch.ones)(_filled(1))
empty = register_function(torch.empty)(_filled(0))


@register_function(torch.full)
def full(size, fill_value, *, dtype=None, device=None, layout=None, requires_grad=False,
         pin_memory=False, out=None):
    return ops.full(tuple(size), fill_value, dtype=dtype, device=device)


def _like(value):
    def rule(input, *fill, dtype=None, device=None, layout=None, requires_grad=False,
             memory_format=None, pin_memory=False):
        return ops.full(input.shape, fill[0] if fill else value, dtype=dtype or input.dtype,
                        device=device or input.device)
    return rule


zeros_like = register_function(torch.zeros_like)(_like(0))
ones_like = register_function(torch.ones_like)(_like(1))
empty_like = register_function(torch.empty_like)(_like(0))
full_like = register_function(torch.full_like)(_like(None))


def _new(value):
    def rule(self, *args, size=None, fill_value=None, dtype=None, device=None, layout=None,
             requires_grad=False, pin_memory=False):
        # x.new_ones(2, 3), x.new_ones((2, 3)) or size=(2, 3); new_full's fill value after the size or by name
        if size is not None:
            args = (size, *args)
        if value is None:
            size, fill = args[0], (args[1] if len(args) > 1 else fill_value)
        else:
            size, fill = dims_arg(args), value
        return ops.full(tuple(size), fill, dtype=dtype or self.dtype, device=device or self.device)
    return rule


new_zeros = register_method("new_zeros")(_new(0))
new_ones = register_method("new_ones")(_new(1))
new_empty = register_method("new_empty")(_new(0))
new_full = register_method("new_full")(_new(None))


def _data_on_device(data, *, device=None, **_) -> bool:
    """Python data, or a tensor on the device asked for (moving between devices inside a graph is
    not mapped)."""
    return not is_tensor(data) or device is None or as_device(device) == data.device


@register_function(torch.tensor, torch.as_tensor, torch.scalar_tensor, check=_data_on_device)
def tensor(data, *, dtype=None, device=None, requires_grad=False, pin_memory=False):
    """A constant from Python data; from a tensor (TAPAS's `torch.as_tensor(ids, device=...)`),
    its values in `dtype` (as `clone`, the same values)."""
    if is_tensor(data):
        return data if dtype is None else ops.cast(data, dtypes.data_type(dtype))
    return asarray(torch.as_tensor(data, dtype=dtype), device=device or "cpu")


def _plain_data(data) -> bool:
    """Python numbers and bools, or (nested) lists and tuples of them: values known when the
    graph is traced."""
    if isinstance(data, (list, tuple)):
        return all(_plain_data(d) for d in data)
    return isinstance(data, (bool, int, float))


def _known_data(self, data, *, dtype=None, device=None, **_) -> bool:
    """Plain data on any device, or a tensor already on the device asked for (moving between
    devices inside a graph is not mapped)."""
    if is_tensor(data):
        return as_device(self.device if device is None else device) == data.device
    return _plain_data(data)


@register_method("new_tensor", check=_known_data)
def new_tensor(self, data, *, dtype=None, device=None, layout=None, requires_grad=False,
               pin_memory=False):
    """A constant from Python data (or a copy of a tensor) with self's dtype and device unless
    given."""
    dtype = dtypes.data_type(dtype or self.dtype)
    if is_tensor(data):
        return ops.cast(data, dtype)
    return asarray(torch.as_tensor(data, dtype=dtype.torch_dtype), device=device or self.device)
