"""Pooling over the last 1, 2 or 3 dimensions, as torch.nn.functional defines it.

Inputs are (N, C, *spatial) or unbatched (C, *spatial). Sliding-window pools (max, avg) reduce
over the kernel window with padding as a select on the bounds (max pads with the lowest value,
avg with zero); adaptive pools reduce over windows whose extents are expressions of the output
index: start = floor(i * in / out), end = ceil((i + 1) * in / out). Averages of 16-bit floats
accumulate in float32.
"""
import math

from kiln import dtypes
from kiln.graph import Layout, OperatorError, Traits, operator
from kiln.ir import cast, compute, maximum, minimum, reduce, select

from kiln_ops_builtin.common import (
    accumulator_type, check_dtype, check_spatial_input, in_bounds, int_tuple,
)


def _lowest(t: dtypes.DataType):
    if t.is_float:
        return -math.inf
    return 0 if t.kind == "uint" else -(1 << (8 * t.nbytes - 1))


def _product(values):
    out = values[0]
    for v in values[1:]:
        out = out * v
    return out


def _split(op: str, x, nd: int, integers: bool) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(leading dims, spatial dims) of a checked input."""
    if integers:
        check_dtype(op, x, dtypes.FLOATS + dtypes.INTEGERS, "a floating-point or integer type")
    else:
        check_dtype(op, x, dtypes.FLOATS)
    check_spatial_input(op, x, nd)
    return x.shape[:-nd], x.shape[-nd:]


def _pooled(x, lead, out_spatial, element):
    """The output compute: `element(leading index, spatial output index)`."""
    nl = len(lead)
    return compute(lead + tuple(out_spatial), lambda *i: element(i[:nl], i[nl:]), dtype=x.dtype)


class _Windows:
    """The sliding windows of a pool over an input of leading dims `lead` and spatial dims `size`:
    sizes checked and output extents computed as torch does."""

    def __init__(self, op, lead, size, kernel_size, stride, padding, dilation, ceil_mode):
        self.lead, self.size = tuple(lead), tuple(size)
        nd = len(self.size)
        self.kernel = int_tuple(op, "kernel_size", kernel_size, nd)
        self.stride = self.kernel if stride in (None, (), []) else int_tuple(op, "stride", stride, nd)
        self.padding = int_tuple(op, "padding", padding, nd)
        self.dilation = int_tuple(op, "dilation", dilation, nd)
        if min(self.kernel + self.stride + self.dilation) < 1 or min(self.padding) < 0:
            raise OperatorError(f"{op}: kernel_size {self.kernel}, stride {self.stride} and dilation "
                                f"{self.dilation} must be positive and padding {self.padding} non-negative")
        span = [d * (k - 1) + 1 for d, k in zip(self.dilation, self.kernel)]
        if any(p > s // 2 for p, s in zip(self.padding, span)):
            raise OperatorError(f"{op}: padding {self.padding} must be at most half of the kernel "
                                f"size {tuple(span)}")
        self.out = []
        for n, s, p, e in zip(self.size, self.stride, self.padding, span):
            o = (n + 2 * p - e + (s - 1 if ceil_mode else 0)) // s + 1
            if ceil_mode and (o - 1) * s >= n + p:
                o -= 1
            self.out.append(o)
        if min(self.out) < 1:
            raise OperatorError(f"{op}: input of shape {self.lead + self.size} is too small for kernel_size "
                                f"{self.kernel} (output {tuple(self.out)})")

    def start(self, o, d):
        return o[d] * self.stride[d] - self.padding[d]

    def read(self, x, lead, o, r, outside):
        """x at window offset `r` of output `o`, or `outside` beyond the input's bounds."""
        pos = [self.start(o, d) + r[d] * self.dilation[d] for d in range(len(r))]
        return select(in_bounds(pos, self.size), x[lead + tuple(pos)], outside)


def _max_pool(op, nd, x, kernel_size, stride, padding, dilation, ceil_mode):
    w = _Windows(op, *_split(op, x, nd, True), kernel_size, stride, padding, dilation, ceil_mode)
    low = _lowest(x.dtype)
    return _pooled(x, w.lead, w.out, lambda lead, o: reduce(
        w.kernel, lambda *r: w.read(x, lead, o, r, low), op="max"))


def _avg_pool(op, nd, x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
    w = _Windows(op, *_split(op, x, nd, False), kernel_size, stride, padding, 1, ceil_mode)
    if divisor_override is not None and (not isinstance(divisor_override, int) or divisor_override == 0):
        raise OperatorError(f"{op}: divisor_override must be a non-zero int, got {divisor_override!r}")
    acc = accumulator_type(x.dtype)

    def element(lead, o):
        total = reduce(w.kernel, lambda *r: cast(w.read(x, lead, o, r, 0), acc), dtype=acc)
        if divisor_override is not None:
            return total / divisor_override
        sizes = []
        for d in range(nd):
            start = w.start(o, d)
            end = minimum(start + w.kernel[d], w.size[d] + w.padding[d])
            sizes.append(end - start if count_include_pad
                         else minimum(end, w.size[d]) - maximum(start, 0))
        return total / cast(_product(sizes), acc)

    return _pooled(x, w.lead, w.out, element)


def _adaptive(op, nd, x, output_size, kind):
    lead, size = _split(op, x, nd, False)
    sizes = (output_size,) * nd if isinstance(output_size, int) or output_size is None else tuple(output_size)
    if len(sizes) == 1:
        sizes *= nd
    out = tuple(n if s is None else s for s, n in zip(sizes, size))
    if len(sizes) != nd or not all(isinstance(s, int) and s > 0 for s in out):
        raise OperatorError(f"{op}: output_size must be a positive int or {nd} of them (None keeps "
                            f"the input size), got {output_size!r}")
    if kind == "max" and min(size) == 0:
        raise OperatorError(f"{op}: input of shape {x.shape} has an empty spatial dimension")
    acc = accumulator_type(x.dtype) if kind == "avg" else x.dtype

    def element(lead, o):
        # windows of one size where the output divides the input (a global pool: the plane)
        uniform = [size[d] % out[d] == 0 for d in range(nd)]
        starts = [o[d] * (size[d] // out[d]) if uniform[d] else o[d] * size[d] // out[d] for d in range(nd)]
        extents = [size[d] // out[d] if uniform[d] else ((o[d] + 1) * size[d] + out[d] - 1) // out[d] - starts[d]
                   for d in range(nd)]
        total = reduce(extents, lambda *r: cast(x[lead + tuple(s + i for s, i in zip(starts, r))], acc),
                       op="sum" if kind == "avg" else "max", dtype=acc)
        return total / cast(_product(extents), acc) if kind == "avg" else total

    return _pooled(x, lead, out, element)


@operator("max_pool1d")
def max_pool1d(x, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False):
    """torch.nn.functional.max_pool1d (without return_indices); pads with -inf."""
    return _max_pool("max_pool1d", 1, x, kernel_size, stride, padding, dilation, ceil_mode)


@operator("max_pool2d", traits=Traits(layout=Layout.OWN_DEFINITION))
def max_pool2d(x, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False):
    """torch.nn.functional.max_pool2d (without return_indices); pads with -inf."""
    return _max_pool("max_pool2d", 2, x, kernel_size, stride, padding, dilation, ceil_mode)


@operator("avg_pool1d")
def avg_pool1d(x, kernel_size, stride=None, padding=0, ceil_mode=False, count_include_pad=True):
    """torch.nn.functional.avg_pool1d."""
    return _avg_pool("avg_pool1d", 1, x, kernel_size, stride, padding, ceil_mode, count_include_pad, None)


@operator("avg_pool2d", traits=Traits(layout=Layout.OWN_DEFINITION))
def avg_pool2d(x, kernel_size, stride=None, padding=0, ceil_mode=False, count_include_pad=True,
               divisor_override=None):
    """torch.nn.functional.avg_pool2d."""
    return _avg_pool("avg_pool2d", 2, x, kernel_size, stride, padding, ceil_mode, count_include_pad,
                     divisor_override)


@operator("adaptive_avg_pool1d")
def adaptive_avg_pool1d(x, output_size):
    """torch.nn.functional.adaptive_avg_pool1d."""
    return _adaptive("adaptive_avg_pool1d", 1, x, output_size, "avg")


@operator("adaptive_avg_pool2d", traits=Traits(layout=Layout.OWN_DEFINITION))
def adaptive_avg_pool2d(x, output_size):
    """torch.nn.functional.adaptive_avg_pool2d; None in output_size keeps that input size."""
    return _adaptive("adaptive_avg_pool2d", 2, x, output_size, "avg")


@operator("adaptive_max_pool1d")
def adaptive_max_pool1d(x, output_size):
    """torch.nn.functional.adaptive_max_pool1d (without return_indices)."""
    return _adaptive("adaptive_max_pool1d", 1, x, output_size, "max")


@operator("adaptive_max_pool2d", traits=Traits(layout=Layout.OWN_DEFINITION))
def adaptive_max_pool2d(x, output_size):
    """torch.nn.functional.adaptive_max_pool2d (without return_indices); None in output_size
    keeps that input size."""
    return _adaptive("adaptive_max_pool2d", 2, x, output_size, "max")


@operator("max_pool3d")
def max_pool3d(x, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False):
    """torch.nn.functional.max_pool3d (without return_indices); pads with -inf."""
    return _max_pool("max_pool3d", 3, x, kernel_size, stride, padding, dilation, ceil_mode)


@operator("avg_pool3d")
def avg_pool3d(x, kernel_size, stride=None, padding=0, ceil_mode=False, count_include_pad=True,
               divisor_override=None):
    """torch.nn.functional.avg_pool3d."""
    return _avg_pool("avg_pool3d", 3, x, kernel_size, stride, padding, ceil_mode, count_include_pad,
                     divisor_override)


@operator("adaptive_avg_pool3d")
def adaptive_avg_pool3d(x, output_size):
    """torch.nn.functional.adaptive_avg_pool3d; None in output_size keeps that input size."""
    return _adaptive("adaptive_avg_pool3d", 3, x, output_size, "avg")


@operator("adaptive_max_pool3d")
def adaptive_max_pool3d(x, output_size):
    """torch.nn.functional.adaptive_max_pool3d (without return_indices)."""
    return _adaptive("adaptive_max_pool3d", 3, x, output_size, "max")
