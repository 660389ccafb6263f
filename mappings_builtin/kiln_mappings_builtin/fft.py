"""torch.fft's transforms and torch.stft, as products with their basis matrices.

A complex value is a `kiln.frontend.torch.complex.ComplexTensor`: a real tensor of its (real,
imaginary) pairs in a last dim of 2 (see `kiln_mappings_builtin.complex` for what computes
on them). A 1-D transform of length n along one dim is one `dft` product (kiln-ops-builtin: a
matmul that is never TF32, as PyTorch's FFTs are not) of the values, that dim moved last, with
a constant basis computed in float64 and rounded once to the input's dtype: zero padding and
truncation (`n=`, `s=`) leave out or keep rows of the basis, `norm=` scales it, and the
Hermitian symmetry of irfft/hfft weighs its rows. Multi-dim transforms apply it dim by dim.
The work is O(n^2) per transform (no butterflies): the lengths of FNet, long convolutions and
spectrograms (up to a few thousand) suit it, float32 and float64.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from kiln import ops
from kiln.frontend.torch import MappingError, register_function, register_method
from kiln.frontend.torch.complex import ComplexTensor
from kiln.tensor import Tensor, from_torch


NORMS = ("backward", "ortho", "forward")
MAX_BASIS_ELEMENTS = 1 << 26    # 256 MB of float32: a complex transform of length 4096
DTYPES = (torch.float32, torch.float64)


def _scale(norm: str | None, n: int, inverse: bool) -> float:
    """The factor `norm` gives a transform of length n ("backward": 1/n on the inverse)."""
    norm = norm or "backward"
    if norm not in NORMS:
        raise ValueError(f"fft: norm must be one of {NORMS}, got {norm!r}")
    if norm == "ortho":
        return n ** -0.5
    return 1.0 / n if (norm == "forward") != inverse else 1.0


@functools.lru_cache(maxsize=32)
def _basis(n: int, rows: int, columns: int, complex_in: bool, complex_out: bool, inverse: bool,
           scale: float) -> np.ndarray:
    """The float64 matrix of a DFT of length n: `rows` input elements (each a (real, imaginary)
    pair where `complex_in`) by `columns` output elements (pairs where `complex_out`; else the
    real part of the transform of the Hermitian spectrum whose first `rows` bins are given)."""
    j, k = np.arange(rows)[:, None], np.arange(columns)[None, :]
    theta = 2 * np.pi * ((j * k) % n) / n    # for a real output, rows are bins, columns samples
    cos, sin = np.cos(theta) * scale, np.sin(theta) * (scale if inverse else -scale)
    if not complex_out:     # bins 1 .. ceil(n/2)-1 stand for their mirror images n-k too
        bins = np.arange(rows)[:, None]
        weight = np.where((bins == 0) | (2 * bins == n), 1.0, 2.0)
        cos, sin = cos * weight, sin * weight
    # (a + ib)(cos + i sin) = (a cos - b sin) + i (a sin + b cos)
    full = np.stack([np.stack([cos, sin], -1), np.stack([-sin, cos], -1)], 1)  # rows, 2, cols, 2
    picked = full[:, :2 if complex_in else 1, :, :2 if complex_out else 1]
    return np.ascontiguousarray(picked.reshape(rows * picked.shape[1], -1))


def _dim(dim: int, ndim: int) -> int:
    if not -ndim <= dim < ndim:
        raise IndexError(f"fft: dim {dim} out of range for {ndim} dims")
    return dim % ndim


def _real_input(x):
    """A real tensor for a transform: integers and bools as float32, as torch promotes them."""
    return x if x.dtype.is_float else ops.cast(x, torch.float32)


def transform(x, dim: int, n: int, columns: int, inverse: bool, norm: str | None,
              complex_out: bool = True):
    """The 1-D DFT of length `n` of `x` (a real Tensor or a ComplexTensor) along `dim`, giving
    its first `columns` bins (a ComplexTensor), or, where not `complex_out`, `columns` real
    samples of the transform of the Hermitian spectrum whose first bins `x` holds (irfft; hfft
    where not `inverse`). `x` is cut or (implicitly) zero-padded to n elements, n//2+1 bins for a
    real output; `norm` as torch.fft's."""
    complex_in = isinstance(x, ComplexTensor)
    data = x.pairs if complex_in else _real_input(x)
    ndim, d = x.ndim, _dim(dim, x.ndim)
    rows = min(x.shape[d], n if complex_out else n // 2 + 1)
    if rows < x.shape[d]:
        data = ops.slice(data, d, 0, rows)
    order = [a for a in range(ndim) if a != d] + [d] + ([ndim] if complex_in else [])
    if d != ndim - 1:
        data = ops.permute(data, order)
    lead = tuple(data.shape[:ndim - 1])
    size = rows * (2 if complex_in else 1) * columns * (2 if complex_out else 1)
    if size > MAX_BASIS_ELEMENTS:
        raise MappingError(f"fft: a transform of length {n} would multiply by a basis of {size} elements "
                           f"(at most {MAX_BASIS_ELEMENTS}): Kiln computes DFTs as matrix products, "
                           "for lengths up to a few thousand")
    basis = _basis(n, rows, columns, complex_in, complex_out, inverse, _scale(norm, n, inverse))
    basis = from_torch(torch.from_numpy(basis).to(data.dtype.torch_dtype).to(data.device.torch()))
    out = ops.dft(ops.reshape(data, [-1, basis.shape[0]]), basis)
    out = ops.reshape(out, list(lead) + [columns] + ([2] if complex_out else []))
    if d != ndim - 1:
        back = [order.index(a) for a in range(ndim)] + ([ndim] if complex_out else [])
        out = ops.permute(out, back)
    return ComplexTensor(out) if complex_out else out


@dataclass(frozen=True)
class Kind:
    """A family of torch.fft functions: whether its last transformed dim has a real input side
    (`onesided`: rfft's real input and half spectrum, irfft's real output) and on which side."""

    inverse: bool
    real_in: bool = False    # rfft, ihfft: real input, bins 0 .. n//2 out
    real_out: bool = False   # irfft, hfft: bins 0 .. n//2 in, real output


KINDS = {"fft": Kind(False), "ifft": Kind(True), "rfft": Kind(False, real_in=True),
         "ihfft": Kind(True, real_in=True), "irfft": Kind(True, real_out=True),
         "hfft": Kind(False, real_out=True)}


def _transforms(kind: Kind, x, dims: list[int], sizes: list[int], norm):
    """x transformed along each of `dims` (the last one the real side of rfft-like kinds)."""
    if kind.real_in:
        x = transform(x, dims[-1], sizes[-1], sizes[-1] // 2 + 1, kind.inverse, norm)
        dims, sizes = dims[:-1], sizes[:-1]
    last = (dims[-1], sizes[-1]) if kind.real_out else None
    for d, n in zip(dims[:-1] if kind.real_out else dims, sizes):
        x = transform(x, d, n, n, kind.inverse, norm)
    if last is not None:
        x = transform(x, last[0], last[1], last[1], kind.inverse, norm, complex_out=False)
    return x


def _default_size(kind: Kind, x, d: int) -> int:
    return 2 * (x.shape[d] - 1) if kind.real_out else x.shape[d]


def _supported(input, *args, out=None, **kwargs) -> bool:
    """A check: float32/float64 (or integer) values, a complex input only where it may be one."""
    dtype = input.real_dtype if isinstance(input, ComplexTensor) else input.dtype.torch_dtype
    return out is None and (dtype in DTYPES or not (dtype.is_floating_point or dtype.is_complex))


def _one_dim(name: str, kind: Kind):
    def rule(input, n=None, dim=-1, norm=None, *, out=None):
        d = _dim(dim, input.ndim)
        return _transforms(kind, input, [d], [n if n is not None else _default_size(kind, input, d)], norm)
    rule.__name__ = rule.__qualname__ = name
    return rule


def _dims_and_sizes(kind: Kind, x, s, dim):
    """torch.fft's (s, dim) resolved: the dims transformed and each one's length."""
    if dim is None:
        dims = list(range(x.ndim)) if s is None else list(range(x.ndim - len(s), x.ndim))
    else:
        dims = [_dim(d, x.ndim) for d in ([dim] if isinstance(dim, int) else dim)]
    if s is None:
        s = [-1] * len(dims)
    sizes = [(_default_size(kind, x, d) if k == len(dims) - 1 else x.shape[d]) if v == -1 else v
             for k, (v, d) in enumerate(zip(s, dims))]
    return dims, sizes


def _n_dim(name: str, kind: Kind, default_dim):
    def rule(input, s=None, dim=default_dim, norm=None, *, out=None):
        dims, sizes = _dims_and_sizes(kind, input, s, dim)
        return _transforms(kind, input, dims, sizes, norm)
    rule.__name__ = rule.__qualname__ = name
    return rule


def _real_only(kind: Kind):
    return lambda input, *args, **kwargs: (not (kind.real_in and isinstance(input, ComplexTensor))
                                           and _supported(input, *args, **kwargs))


for _name, _kind in KINDS.items():
    register_function(getattr(torch.fft, _name), check=_real_only(_kind))(_one_dim(_name, _kind))
    register_function(getattr(torch.fft, f"{_name}2"), check=_real_only(_kind))(
        _n_dim(f"{_name}2", _kind, (-2, -1)))
    register_function(getattr(torch.fft, f"{_name}n"), check=_real_only(_kind))(
        _n_dim(f"{_name}n", _kind, None))


def _shift(name: str, sign: int):
    def rule(input, dim=None):
        """The zero-frequency bin moved to the middle of each of `dim` (all dims when None), or back."""
        dims = list(range(input.ndim)) if dim is None else [_dim(d, input.ndim) for d in
                                                             ([dim] if isinstance(dim, int) else dim)]
        shifts = [sign * (input.shape[d] // 2) for d in dims]
        if isinstance(input, ComplexTensor):
            return ComplexTensor(ops.roll(input.pairs, shifts, dims))
        return ops.roll(input, shifts, dims)
    rule.__name__ = rule.__qualname__ = name
    return register_function(getattr(torch.fft, name))(rule)


fftshift, ifftshift = _shift("fftshift", 1), _shift("ifftshift", -1)


def _no_tensors(*args, **kwargs) -> bool:
    return not any(isinstance(a, Tensor) for a in (*args, *kwargs.values()))


def _frequencies(function):
    def rule(n, d=1.0, *, dtype=None, device=None, **kwargs):
        """The bins' frequencies, which take no tensor: computed by PyTorch when the graph is traced."""
        return from_torch(function(n, d, dtype=dtype, device=device))
    rule.__name__ = rule.__qualname__ = function.__name__
    return register_function(function, check=_no_tensors)(rule)


fftfreq, rfftfreq = _frequencies(torch.fft.fftfreq), _frequencies(torch.fft.rfftfreq)


def _stft_supported(input, n_fft, hop_length=None, win_length=None, window=None, center=True,
                    pad_mode="reflect", *args, **kwargs) -> bool:
    return (isinstance(input, Tensor) and input.ndim in (1, 2) and _supported(input)
            and (window is None or isinstance(window, Tensor))
            and pad_mode in ("reflect", "constant", "replicate"))


@register_function(torch.stft, check=_stft_supported)
@register_method("stft", check=_stft_supported)
def stft(input, n_fft, hop_length=None, win_length=None, window=None, center=True,
         pad_mode="reflect", normalized=False, onesided=None, return_complex=None):
    """torch.stft of a real signal (L,) or batch (B, L): frames of n_fft samples every
    hop_length (after padding n_fft//2 on each side by `pad_mode` where `center`), each times
    the window (centered in n_fft where shorter), transformed: (B,) n_fft//2+1 (onesided) or
    n_fft bins by frames, complex (or its view_as_real where return_complex is False)."""
    hop = hop_length or n_fft // 4
    win_length = win_length or n_fft
    x = _real_input(input if input.ndim == 2 else ops.unsqueeze(input, 0))
    if center:
        x = ops.pad(x, [n_fft // 2, n_fft // 2], mode=pad_mode)
    if window is None and win_length < n_fft:
        window = ops.full([win_length], 1.0, dtype=x.dtype.torch_dtype, device=x.device.torch())
    if window is not None and win_length < n_fft:
        left = (n_fft - win_length) // 2
        window = ops.pad(window, [left, n_fft - win_length - left])
    batch, length = x.shape
    frames = ops.as_strided(x, [batch, 1 + (length - n_fft) // hop, n_fft], [length, hop, 1])
    if window is not None:
        frames = ops.mul(frames, window)
    bins = n_fft // 2 + 1 if onesided is not False else n_fft
    spectrum = transform(frames, -1, n_fft, bins, False, "ortho" if normalized else "backward")
    pairs = ops.permute(spectrum.pairs, [0, 2, 1, 3])
    if input.ndim == 1:
        pairs = ops.squeeze(pairs, 0)
    return ComplexTensor(pairs) if return_complex is not False else pairs

