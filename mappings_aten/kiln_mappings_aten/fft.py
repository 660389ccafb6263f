"""ATen's FFTs and complex element-wise ops in training graphs (AOTAutograd's forward and
backward of torch.fft / torch.stft), on the `ComplexTensor`s and transforms of
`kiln_mappings_builtin.complex_values` and `kiln_mappings_builtin.fft`.

`_fft_r2c`, `_fft_c2r` and `_fft_c2c` get their input padded or cut already, and a
`normalization` of 0 (none), 1 (1/sqrt(n)) or 2 (1/n). A complex value a graph saves for the
backward (the spectra of a long convolution) is a complex graph output, which Kiln does not
return: such a graph compiles under fallback_to_eager only, with those nodes in PyTorch.
"""
from __future__ import annotations

import torch

from kiln import ops
from kiln.frontend.torch import register_function
from kiln.frontend.torch.complex import REAL_OF, ComplexTensor
from kiln_mappings_builtin import complex_values as complex_
from kiln_mappings_builtin.fft import transform

from kiln_mappings_aten.common import aten


def _norm(normalization: int, inverse: bool) -> str:
    """torch.fft's `norm` of ATen's `normalization` (0: none, 1: 1/sqrt(n), 2: 1/n)."""
    return ("ortho" if normalization == 1 else
            ("forward" if inverse else "backward") if normalization == 0 else
            ("backward" if inverse else "forward"))


@register_function(aten._fft_r2c.default)
def fft_r2c(self, dim, normalization, onesided):
    """The forward transform of a real input along `dim`, the last one halved where `onesided`."""
    *rest, last = dim
    n = self.shape[last]
    x = transform(self, last, n, n // 2 + 1 if onesided else n, False, _norm(normalization, False))
    for d in rest:
        x = transform(x, d, x.shape[d], x.shape[d], False, _norm(normalization, False))
    return x


@register_function(aten._fft_c2r.default)
def fft_c2r(self, dim, normalization, last_dim_size):
    """The inverse transform to a real output of `last_dim_size` along the last of `dim`."""
    *rest, last = dim
    for d in rest:
        self = transform(self, d, self.shape[d], self.shape[d], True, _norm(normalization, True))
    return transform(self, last, last_dim_size, last_dim_size, True, _norm(normalization, True), complex_out=False)


@register_function(aten._fft_c2c.default)
def fft_c2c(self, dim, normalization, forward):
    for d in dim:
        self = transform(self, d, self.shape[d], self.shape[d], not forward, _norm(normalization, not forward))
    return self


def _to_complex(x, dtype=None, **_) -> bool:
    return dtype in REAL_OF and REAL_OF[dtype] in (torch.float32, torch.float64)


@register_function(aten._to_copy.default, priority=complex_.PRIORITY, check=_to_complex)
def to_complex(x, dtype=None, **_):
    """A real tensor as a complex one (no imaginary part), or a complex one in another precision."""
    real = REAL_OF[dtype]
    pairs = x.pairs if isinstance(x, ComplexTensor) else ops.pad(ops.unsqueeze(x, -1), [0, 1])
    return ComplexTensor(pairs if pairs.dtype.torch_dtype == real else ops.cast(pairs, real))


def _complex_rule(name: str, function, *targets, check=complex_._any_complex):
    def rule(*args, **kwargs):
        return function(*args, **kwargs)
    rule.__name__ = rule.__qualname__ = name
    register_function(*targets, priority=complex_.PRIORITY, check=check)(rule)


_complex_rule("add", complex_.add, aten.add.Tensor, aten.add.Scalar)
_complex_rule("sub", complex_.sub, aten.sub.Tensor, aten.sub.Scalar)
_complex_rule("mul", complex_.mul, aten.mul.Tensor, aten.mul.Scalar)
_complex_rule("div", complex_.div, aten.div.Tensor, aten.div.Scalar)
_complex_rule("neg", complex_.neg, aten.neg.default)
_complex_rule("conj", complex_.conjugate, aten._conj.default, aten.conj_physical.default)
_complex_rule("abs", complex_.absolute, aten.abs.default)
_complex_rule("angle", complex_.angle, aten.angle.default)
_complex_rule("sgn", complex_.sign, aten.sgn.default)
_complex_rule("clone", complex_.resolved, aten.clone.default, aten.alias.default,
              aten.resolve_conj.default, aten.resolve_neg.default)
_complex_rule("view_as_real", complex_.view_as_real, aten.view_as_real.default, check=complex_._first_complex)
_complex_rule("view_as_complex", complex_.view_as_complex, aten.view_as_complex.default, check=lambda x: True)
_complex_rule("transpose", complex_.transpose, aten.transpose.int)
_complex_rule("permute", complex_.permute, aten.permute.default)
_complex_rule("view", complex_.reshape, aten.view.default, aten.reshape.default, aten._unsafe_view.default)
_complex_rule("unsqueeze", complex_.unsqueeze, aten.unsqueeze.default)
