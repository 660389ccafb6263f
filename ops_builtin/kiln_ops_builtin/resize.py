"""interpolate: resizing of 1 to 3 spatial dimensions by nearest or (bi/tri)linear sampling.

The source positions follow PyTorch's CPU kernels exactly: nearest computes
min(floor(i * scale), in - 1) and nearest-exact min(floor((i + 0.5) * scale), in - 1) in
float32; linear computes the source coordinate, the two neighbours and their weights in the
input's compute type (float64 for float64, else float32).
"""
import math

import numpy as np

from kiln import dtypes
from kiln.graph import OperatorError, operator
from kiln.ir import cast, compute, floor, maximum, minimum, select

from kiln_ops_builtin.common import check_dtype

MODES = {"nearest": (1, 2, 3), "nearest-exact": (1, 2, 3), "linear": (1,), "bilinear": (2,),
         "trilinear": (3,)}


def _output_sizes(size, scale_factor, spatial, recompute_scale_factor):
    """(output sizes, per-dimension scale factors or None) as torch's interpolate computes them."""
    nd = len(spatial)
    if (size is None) == (scale_factor is None):
        raise OperatorError("interpolate: exactly one of size and scale_factor must be given, "
                            f"got size={size!r}, scale_factor={scale_factor!r}")
    if size is not None:
        out = (size,) * nd if isinstance(size, int) else tuple(size)
        if len(out) != nd or not all(isinstance(s, int) and s > 0 for s in out):
            raise OperatorError(f"interpolate: size must be a positive int or {nd} of them, got {size!r}")
        return out, (None,) * nd
    scales = (scale_factor,) * nd if isinstance(scale_factor, (int, float)) else tuple(scale_factor)
    if len(scales) != nd or not all(isinstance(s, (int, float)) and s > 0 for s in scales):
        raise OperatorError(f"interpolate: scale_factor must be a positive number or {nd} of them, "
                            f"got {scale_factor!r}")
    out = tuple(math.floor(float(n) * s) for n, s in zip(spatial, scales))
    if min(out) < 1:
        raise OperatorError(f"interpolate: scale_factor {scale_factor!r} gives an empty output {out}")
    return out, (None,) * nd if recompute_scale_factor else tuple(float(s) for s in scales)


def _ratio(n: int, out: int, scale, align_corners: bool, real):
    """Source step per output step, rounded to the numpy type `real` as torch rounds it."""
    if align_corners:
        return real(n - 1) / real(out - 1) if out > 1 else real(0)
    if scale is not None:
        return real(1.0 / scale)
    return real(n) / real(out)


def _nearest(i, n: int, out: int, scale, exact: bool):
    if out == n:
        return i
    if out == 2 * n and not exact:
        return i // 2
    ratio = float(_ratio(n, out, scale, False, np.float32))
    pos = cast(i, dtypes.float32) + 0.5 if exact else cast(i, dtypes.float32)
    return minimum(cast(floor(pos * ratio), dtypes.int64), n - 1)


def _linear(i, n: int, out: int, scale, align_corners: bool, t: dtypes.DataType):
    """The two source neighbours of output index `i` and their weights."""
    ratio = float(_ratio(n, out, scale, align_corners, np.float64 if t == dtypes.float64 else np.float32))
    pos = cast(i, t)
    if align_corners:
        src = pos * ratio
    else:
        src = (pos + 0.5) * ratio - 0.5
        src = select(src < 0, 0, src)
    i0 = minimum(cast(floor(src), dtypes.int64), n - 1)
    w1 = minimum(maximum(src - cast(i0, t), 0), 1)
    return (i0, 1 - w1), (i0 + select(i0 < n - 1, 1, 0), w1)


@operator("interpolate")
def interpolate(x, size=None, scale_factor=None, mode="nearest", align_corners=None,
                recompute_scale_factor=None):
    """torch.nn.functional.interpolate for modes 'nearest' and 'nearest-exact' (3-D to 5-D
    input, floating-point or uint8), and 'linear' (3-D), 'bilinear' (4-D) and 'trilinear' (5-D)
    of floating-point inputs."""
    if mode not in MODES:
        raise OperatorError(f"interpolate: unsupported mode {mode!r}; expected one of {', '.join(MODES)}")
    nd = x.ndim - 2
    if nd not in MODES[mode]:
        ranks = " or ".join(f"{d + 2}-D" for d in MODES[mode])
        raise OperatorError(f"interpolate: mode {mode!r} expects a {ranks} input, got shape {x.shape}")
    nearest = mode.startswith("nearest")
    if nearest:
        check_dtype("interpolate", x, dtypes.FLOATS + (dtypes.uint8,), "floating-point or uint8")
        if align_corners is not None:
            raise OperatorError("interpolate: align_corners can only be set with the interpolating "
                                f"modes linear, bilinear and trilinear, not {mode!r}")
    else:
        check_dtype("interpolate", x, dtypes.FLOATS)
    spatial = x.shape[2:]
    out, scales = _output_sizes(size, scale_factor, spatial, recompute_scale_factor)

    if nearest:
        exact = mode == "nearest-exact"
        return compute(x.shape[:2] + out, lambda b, c, *o: x[(b, c) + tuple(
            _nearest(i, n, m, s, exact) for i, n, m, s in zip(o, spatial, out, scales))])

    t = dtypes.float64 if x.dtype == dtypes.float64 else dtypes.float32

    def element(b, c, *o):
        taps = [None if m == n else _linear(i, n, m, s, bool(align_corners), t)
                for i, n, m, s in zip(o, spatial, out, scales)]

        def blend(d, index):
            if d == nd:
                return cast(x[(b, c) + index], t)
            if taps[d] is None:
                return blend(d + 1, index + (o[d],))
            (i0, w0), (i1, w1) = taps[d]
            return blend(d + 1, index + (i0,)) * w0 + blend(d + 1, index + (i1,)) * w1

        return blend(0, ())

    return compute(x.shape[:2] + out, element, dtype=x.dtype)
