"""Complex tensors inside a graph: arithmetic, parts, magnitudes and the views between real
pairs and complex values, on `kiln.frontend.torch.complex.ComplexTensor`s (a real tensor of
(real, imaginary) pairs in a last dim of 2).

Each rule here takes a call where an argument is complex (its check says so) and computes on
the pairs with the real operators, at a priority above the real rules of the same targets, so
that a real call never sees them. A complex call no rule here takes falls to the real rules,
which fail on it naming its complex64 argument (or, under fallback_to_eager, run in PyTorch).
Shapes broadcast as PyTorch's: the pairs' last dim stays last.
"""
from __future__ import annotations

import operator

import torch

from kiln import ops
from kiln.frontend.torch import register_function, register_method
from kiln.frontend.torch.complex import ComplexTensor, REAL_OF
from kiln.tensor import Tensor, from_torch

from kiln_mappings_builtin.common import dims_arg
from kiln_mappings_builtin.indexing import getitem

PRIORITY = 20


def _any_complex(*args, **kwargs) -> bool:
    return any(isinstance(a, (ComplexTensor, complex)) for a in (*args, *kwargs.values()))


def _first_complex(*args, **kwargs) -> bool:
    return bool(args) and isinstance(args[0], ComplexTensor)


def complex_rule(*functions, methods=(), check=_any_complex):
    """Register a rule for complex calls of `functions` and Tensor `methods`."""
    def register(rule):
        if functions:
            register_function(*functions, priority=PRIORITY, check=check)(rule)
        if methods:
            register_method(*methods, priority=PRIORITY, check=check)(rule)
        return rule
    return register


def part(z: ComplexTensor, k: int) -> Tensor:
    """The real (k=0) or imaginary (k=1) part of z."""
    return ops.squeeze(ops.slice(z.pairs, -1, k, k + 1), -1)


def _pairs(value, dtype: torch.dtype, device) -> Tensor:
    """`value` (complex, real tensor or Python number) as (real, imaginary) pairs."""
    if isinstance(value, ComplexTensor):
        return value.pairs
    if isinstance(value, (int, float, complex, bool)):
        number = complex(value)
        return from_torch(torch.tensor([number.real, number.imag], dtype=dtype, device=device.torch()))
    real = value if value.dtype.is_float else ops.cast(value, dtype)
    return ops.pad(ops.unsqueeze(real, -1), [0, 1])     # (x, 0)


def _complex_dtype_of(*values) -> torch.dtype:
    """The real dtype of the pairs a complex result of `values` takes (float64 wins, as PyTorch
    promotes complex64 with float64 to complex128)."""
    wide = any((isinstance(v, ComplexTensor) and v.real_dtype == torch.float64) or
               (isinstance(v, Tensor) and v.dtype.torch_dtype == torch.float64) for v in values)
    return torch.float64 if wide else torch.float32


def _as_complex(value, *others) -> ComplexTensor:
    """`value` as a complex tensor of the dtype and on the device a result of it and `others` takes."""
    dtype = _complex_dtype_of(value, *others)
    device = next(v.device for v in (value, *others) if isinstance(v, (Tensor, ComplexTensor)))
    pairs = _pairs(value, dtype, device)
    return ComplexTensor(pairs if pairs.dtype.torch_dtype == dtype else ops.cast(pairs, dtype))


def _make(re: Tensor, im: Tensor) -> ComplexTensor:
    return ComplexTensor(ops.stack([re, im], -1))


def multiply(a, b) -> ComplexTensor:
    """a * b, either one complex (the other may be real or a number)."""
    if not isinstance(a, ComplexTensor):
        a, b = b, a
    if not isinstance(a, ComplexTensor):    # a Python complex number times a real tensor
        a = _as_complex(a, b)
    if isinstance(b, (ComplexTensor, complex)):
        a, b = _as_complex(a, b), _as_complex(b, a)
        ar, ai, br, bi = part(a, 0), part(a, 1), part(b, 0), part(b, 1)
        return _make(ops.sub(ops.mul(ar, br), ops.mul(ai, bi)), ops.add(ops.mul(ar, bi), ops.mul(ai, br)))
    return ComplexTensor(ops.mul(a.pairs, ops.unsqueeze(b, -1) if isinstance(b, Tensor) else b))


def _sum(a, b, sign: int) -> ComplexTensor:
    a, b = _as_complex(a, b), _as_complex(b, a)
    return ComplexTensor(ops.add(a.pairs, b.pairs) if sign > 0 else ops.sub(a.pairs, b.pairs))


def conj(z: ComplexTensor) -> ComplexTensor:
    return _make(part(z, 0), ops.neg(part(z, 1)))


def magnitude(z: ComplexTensor) -> Tensor:
    return ops.hypot(part(z, 0), part(z, 1))


def divide(a, b) -> ComplexTensor:
    """a / b: by a real divisor part by part, by a complex one as a * conj(b) / |b|^2."""
    if not isinstance(b, (ComplexTensor, complex)):
        return ComplexTensor(ops.div(a.pairs, ops.unsqueeze(b, -1) if isinstance(b, Tensor) else b))
    b = _as_complex(b, a)
    re, im = part(b, 0), part(b, 1)
    square = ops.add(ops.mul(re, re), ops.mul(im, im))
    return ComplexTensor(ops.div(multiply(a, conj(b)).pairs, ops.unsqueeze(square, -1)))


def _scaled(value, alpha):
    if alpha == 1:
        return value
    return multiply(value, alpha) if isinstance(value, ComplexTensor) else ops.mul(value, alpha)


@complex_rule(operator.add, operator.iadd, torch.add, methods=("add", "__add__", "__radd__"))
def add(input, other, *, alpha=1):
    return _sum(input, _scaled(other, alpha), 1)


@complex_rule(operator.sub, operator.isub, torch.sub, torch.subtract, methods=("sub", "subtract", "__sub__"))
def sub(input, other, *, alpha=1):
    return _sum(input, _scaled(other, alpha), -1)


@complex_rule(methods=("__rsub__",))
def rsub(input, other):
    return _sum(other, input, -1)


@complex_rule(operator.mul, operator.imul, torch.mul, torch.multiply, methods=("mul", "multiply", "__mul__", "__rmul__"))
def mul(input, other):
    return multiply(input, other)


@complex_rule(operator.truediv, operator.itruediv, torch.div, torch.divide, torch.true_divide,
              methods=("div", "divide", "true_divide", "__truediv__"))
def div(input, other, *, rounding_mode=None):
    if rounding_mode is not None:
        raise NotImplementedError("complex division has no rounding mode")
    if isinstance(input, ComplexTensor):
        return divide(input, other)
    return divide(_as_complex(input, other), other)


@complex_rule(methods=("__rtruediv__",))
def rdiv(input, other):
    return div(other, input)


@complex_rule(operator.neg, torch.neg, torch.negative, methods=("neg", "negative", "__neg__"))
def neg(input):
    return ComplexTensor(ops.neg(input.pairs))


@complex_rule(torch.conj, torch.conj_physical, methods=("conj", "conj_physical"))
def conjugate(input):
    return conj(input)


@complex_rule(torch.resolve_conj, torch.resolve_neg, methods=("resolve_conj", "resolve_neg", "contiguous", "clone"),
              check=_first_complex)
def resolved(input, *args, **kwargs):
    return input


@register_function(torch.conj, torch.conj_physical, torch.resolve_conj, torch.resolve_neg, torch.real)
@register_method("conj", "conj_physical", "resolve_conj", "resolve_neg")
def real_identity(input):
    """The conjugate (and real part) of a real tensor is the tensor itself."""
    return input


@complex_rule(torch.abs, torch.absolute, operator.abs, methods=("abs", "absolute", "__abs__"))
def absolute(input):
    return magnitude(input)


@complex_rule(torch.sgn, methods=("sgn",))
def sign(input):
    """z / |z|, and 0 where z is 0."""
    size = magnitude(input)
    safe = ops.where(ops.eq(size, 0), ops.full([], 1.0, dtype=input.real_dtype, device=input.device.torch()), size)
    return ComplexTensor(ops.div(input.pairs, ops.unsqueeze(safe, -1)))


@complex_rule(torch.angle, methods=("angle",))
def angle(input):
    return ops.atan2(part(input, 1), part(input, 0))


@complex_rule(torch.real, methods=())
def real(input):
    return part(input, 0)


@complex_rule(torch.imag, methods=())
def imag(input):
    return part(input, 1)


ATTRIBUTES = {"real": lambda z: part(z, 0), "imag": lambda z: part(z, 1), "shape": lambda z: torch.Size(z.shape),
              "dtype": lambda z: z.dtype, "device": lambda z: z.device.torch(), "ndim": lambda z: z.ndim,
              "is_cuda": lambda z: z.device.is_cuda}


@register_function(getattr, priority=PRIORITY,
                   check=lambda obj, name, *default: isinstance(obj, ComplexTensor) and name in ATTRIBUTES)
def complex_attribute(obj, name, *default):
    return ATTRIBUTES[name](obj)


@register_function(getattr, check=lambda obj, name, *default: isinstance(obj, Tensor) and name == "real")
def real_attribute(obj, name, *default):
    """`x.real` of a real tensor: x."""
    return obj


@register_function(torch.view_as_real, check=_first_complex)
def view_as_real(input):
    return input.pairs


@register_function(torch.view_as_complex,
                   check=lambda input: isinstance(input, Tensor) and input.ndim > 0 and input.shape[-1] == 2
                   and input.dtype.torch_dtype in REAL_OF.values())
def view_as_complex(input):
    return ComplexTensor(input)


@register_function(torch.polar)
def polar(abs, angle):
    """abs * (cos(angle) + i sin(angle))."""
    return _make(ops.mul(abs, ops.cos(angle)), ops.mul(abs, ops.sin(angle)))


@register_function(torch.complex)
def make_complex(real, imag):
    shape = torch.broadcast_shapes(tuple(real.shape), tuple(imag.shape))
    return _make(ops.broadcast_to(real, list(shape)), ops.broadcast_to(imag, list(shape)))


# shape changes: the real rule's on the pairs, their last dim kept last

@complex_rule(methods=("reshape", "view"), check=_first_complex)
def reshape(input, *shape):
    return ComplexTensor(ops.reshape(input.pairs, list(dims_arg(shape)) + [2]))


@complex_rule(operator.getitem, methods=("__getitem__",), check=_first_complex)
def complex_getitem(input, index):
    items = tuple(index) if isinstance(index, tuple) else (index,)
    tail = (slice(None),) if any(i is Ellipsis for i in items) else (Ellipsis, slice(None))
    return ComplexTensor(getitem(input.pairs, items + tail))


@complex_rule(torch.unsqueeze, methods=("unsqueeze",), check=_first_complex)
def unsqueeze(input, dim):
    return ComplexTensor(ops.unsqueeze(input.pairs, dim % (input.ndim + 1)))


@complex_rule(torch.permute, methods=("permute",), check=_first_complex)
def permute(input, *dims):
    return ComplexTensor(ops.permute(input.pairs, [d % input.ndim for d in dims_arg(dims)] + [input.ndim]))


@complex_rule(torch.transpose, methods=("transpose",), check=_first_complex)
def transpose(input, dim0, dim1):
    return ComplexTensor(ops.transpose(input.pairs, dim0 % input.ndim, dim1 % input.ndim))


@complex_rule(torch.flatten, methods=("flatten",), check=_first_complex)
def flatten(input, start_dim=0, end_dim=-1):
    if input.ndim == 0:
        return reshape(input, 1)
    return ComplexTensor(ops.flatten(input.pairs, start_dim % input.ndim, end_dim % input.ndim))
