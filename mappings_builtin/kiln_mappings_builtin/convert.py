"""Dtype and device conversions, and what a tensor says about itself (size, dim, dtype, ...)."""
import torch

from kiln import dtypes, ops
from kiln.frontend.torch import register_function, register_method
from kiln.tensor import Tensor, from_torch

from kiln_mappings_builtin.common import is_tensor

DTYPE_METHODS = {"float": torch.float32, "half": torch.float16, "double": torch.float64,
                 "bfloat16": torch.bfloat16, "int": torch.int32, "long": torch.int64,
                 "short": torch.int16, "char": torch.int8, "byte": torch.uint8, "bool": torch.bool}


def _cast(x: Tensor, dtype) -> Tensor:
    return x if dtype is None or dtypes.data_type(dtype) == x.dtype else ops.cast(x, dtype)


def _conversion(self, *args, dtype=None, device=None, **_):
    """The dtype and device a `to`/`type` call asks for (a tensor argument gives both)."""
    for a in args:
        if isinstance(a, torch.dtype):
            dtype = a
        elif is_tensor(a):
            dtype, device = a.dtype, a.device.torch()
        elif isinstance(a, (str, torch.device)):
            device = a
    return dtype, device


def _same_device(self, *args, **kwargs) -> bool:
    device = _conversion(self, *args, **kwargs)[1]
    return device is None or torch.device(device).type == self.device.torch().type


def _moved(x: Tensor, device) -> Tensor:
    """`x` on `device`: itself where it is there, a constant on `device` where its values are
    known (a tensor a forward builds from constants, `torch.arange(n).to(x.device)`); a
    symbolic tensor on another device is not mapped (the check declines it)."""
    if device is None or torch.device(device).type == x.device.torch().type:
        return x
    return from_torch(x.torch().to(device))


def _movable(self, *args, **kwargs) -> bool:
    return not self.is_symbolic or _same_device(self, *args, **kwargs)


@register_method("to", check=_movable)
def to(self, *args, **kwargs):
    dtype, device = _conversion(self, *args, **kwargs)
    return _moved(_cast(self, dtype), device)


@register_method("cpu", check=lambda self, *args, **kwargs: not self.device.is_cuda or not self.is_symbolic)
def cpu(self, *args, **kwargs):
    """`x.cpu()`: the tensor itself on the CPU, a CPU constant of a CUDA tensor whose values are
    known (moving a symbolic tensor between devices inside a graph is not mapped)."""
    return _moved(self, "cpu")


@register_method("cuda", check=lambda self, *args, **kwargs: self.device.is_cuda or not self.is_symbolic)
def cuda(self, device=None, *args, **kwargs):
    """`x.cuda()`: the tensor itself on a GPU, a CUDA constant of a CPU tensor whose values are
    known (moving a symbolic tensor between devices inside a graph is not mapped)."""
    return self if self.device.is_cuda else _moved(self, "cuda" if device is None else device)


@register_method("type", check=lambda self, dtype=None, **_: isinstance(dtype, torch.dtype))
def type_(self, dtype=None, non_blocking=False):
    return _cast(self, dtype)


@register_method("type_as")
def type_as(self, other):
    return _cast(self, other.dtype)


def _dtype_method(dtype):
    def rule(self, memory_format=None):
        return _cast(self, dtype)
    rule.__name__ = rule.__qualname__ = str(dtype).replace("torch.", "to_")
    return rule


for _name, _dtype in DTYPE_METHODS.items():
    register_method(_name)(_dtype_method(_dtype))


@register_method("size")
def size(self, dim=None):
    return torch.Size(self.shape) if dim is None else self.shape[dim]


@register_method("item", check=lambda self: not self.is_symbolic)
def item(self):
    """The value of a one-element tensor whose values are known when the graph is traced (a
    constant, or a module's float attribute that dynamo passes as a tensor: the backend traces
    a graph again when it changes)."""
    return self.torch().item()


@register_method("dim", "ndimension")
def dim(self):
    return self.ndim


@register_function(torch.numel)
@register_method("numel", "nelement")
def numel(self):
    return self.numel()


@register_method("is_floating_point")
def is_floating_point(self):
    return self.dtype.is_float


ATTRIBUTES = {"shape": lambda t: torch.Size(t.shape), "dtype": lambda t: t.dtype.torch_dtype,
              "device": lambda t: t.device.torch(), "ndim": lambda t: t.ndim,
              "is_cuda": lambda t: t.device.is_cuda, "T": lambda t: ops.permute(t, list(range(t.ndim))[::-1]),
              "mT": lambda t: ops.transpose(t, -2, -1), "data": lambda t: t,
              # real tensors only: the conjugate transposes are the transposes
              "mH": lambda t: ops.transpose(t, -2, -1), "H": lambda t: ops.transpose(t, 0, 1)}


@register_function(getattr, check=lambda obj, name, *default: is_tensor(obj) and name in ATTRIBUTES)
def tensor_attribute(obj, name, *default):
    return ATTRIBUTES[name](obj)


@register_function(torch.is_floating_point)
def torch_is_floating_point(input):
    return input.dtype.is_float
