"""Max pooling with the positions of its maxima, and the gradient that flows back through them.

`max_pool{1,2,3}d_with_indices` return torch's pair: the pooled values and, for each, the flat
position (over the input's spatial dims) of the first largest element of its window. Padding
never wins: where a window holds only the lowest value, the position is the window's first
in-bounds element, as in torch's kernels. `max_pool{n}d_with_indices_backward` gathers rather
than scatters: each input element sums the output gradients of the windows that contain it and
chose it (at most prod(kernel) candidates), so it needs no atomics and is deterministic. Where a
window holds several NaNs, the position is the first (torch's kernels take the last).

`max_pool{n}d_with_offsets` gives the same maxima as int8 offsets within their windows (row-major
over the kernel, at most 127 elements) instead of int64 positions, and
`max_pool{n}d_offsets_backward` the gradient through them, from the input's size alone: what a
training forward saves for the backward is then one byte an output, and not the input.
"""
from __future__ import annotations

import math

from kiln import dtypes
from kiln.graph import OperatorError, operator
from kiln.ir import cast, compute, eq, maximum, reduce, select

from kiln_ops_builtin.common import accumulator_type, check_dtype, in_bounds
from kiln_ops_builtin.pool import _lowest, _max_pool, _split, _Windows

MAX_OFFSETS = 127       # window elements an int8 offset can name


def _first_in_bounds(w: _Windows, start, d: int):
    """The first window offset along dim `d` whose position is at or after 0 (a window may start
    in the padding)."""
    skipped = maximum(-start, 0)
    return (skipped + w.dilation[d] - 1) // w.dilation[d]


def _window_offsets(w: _Windows, x, lead, o):
    """Per spatial dim, the offset in window `o` of its first largest element (one inside the
    input where the window holds only the lowest value)."""
    nd = len(w.kernel)
    p = reduce(w.kernel, lambda *r: w.read(x, lead, o, r, _lowest(x.dtype)), op="argmax")
    return [maximum(p // math.prod(w.kernel[d + 1:]) % w.kernel[d], _first_in_bounds(w, w.start(o, d), d))
            for d in range(nd)]


def _maxima(op, nd, x, kernel_size, stride, padding, dilation, ceil_mode, dtype, where):
    """The pooled values and, for each, `where(w, offsets along each dim, o)` as `dtype`."""
    w = _Windows(op, *_split(op, x, nd, True), kernel_size, stride, padding, dilation, ceil_mode)
    nl = len(w.lead)

    def element(*i):
        return cast(where(w, _window_offsets(w, x, i[:nl], i[nl:]), i[nl:]), dtype)

    values = _max_pool(op, nd, x, kernel_size, stride, padding, dilation, ceil_mode)
    return values, compute(w.lead + tuple(w.out), element, dtype=dtype)


def _position(w: _Windows, r, o):
    """The flat position over the input's spatial dims of offsets `r` in window `o`."""
    flat = 0
    for d in range(len(r)):
        flat = flat * w.size[d] + w.start(o, d) + r[d] * w.dilation[d]
    return flat


def _linear(w: _Windows, r):
    """Offsets `r` along each dim as one offset, row-major over the kernel."""
    flat = 0
    for d in range(len(r)):
        flat = flat * w.kernel[d] + r[d]
    return flat


def _gradient(op, grad, w: _Windows, chosen, chosen_shape, dtype):
    """The input gradient of a max pool over windows `w`: each input element sums the gradients
    of the windows that chose it, `chosen(at, offsets r, flat position)` telling whether the
    window at output index `at` did (its record of choices of shape `chosen_shape`)."""
    check_dtype(op, grad, dtypes.FLOATS)
    expected = w.lead + tuple(w.out)
    if tuple(grad.shape) != expected or tuple(chosen_shape) != expected:
        raise OperatorError(f"{op}: grad_output {grad.shape} and the maxima {tuple(chosen_shape)} must both "
                            f"have the pooled shape {expected} of input {w.lead + w.size}")
    acc = accumulator_type(grad.dtype)
    nl, nd = len(w.lead), len(w.size)

    def element(*i):
        lead, pos = i[:nl], i[nl:]
        flat = 0
        for d in range(nd):
            flat = flat * w.size[d] + pos[d]

        def contribution(*r):
            shifted = [pos[d] + w.padding[d] - r[d] * w.dilation[d] for d in range(nd)]
            o = [s // w.stride[d] for d, s in enumerate(shifted)]
            ok = in_bounds(o, w.out)
            for d in range(nd):
                ok = ok & eq(shifted[d] % w.stride[d], 0)
            at = lead + tuple(o)
            return select(ok, select(chosen(at, r, flat), cast(grad[at], acc), 0), 0)

        return cast(reduce(w.kernel, contribution, dtype=acc), grad.dtype)

    return compute(w.lead + w.size, element, dtype=dtype)


def _define(nd: int):
    name = f"max_pool{nd}d_with_indices"
    offsets_name = f"max_pool{nd}d_with_offsets"

    def forward(x, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False):
        return _maxima(name, nd, x, kernel_size, stride, padding, dilation, ceil_mode, dtypes.int64, _position)

    def backward(grad, x, kernel_size, stride, padding, dilation, ceil_mode, indices):
        op = name + "_backward"
        w = _Windows(op, *_split(op, x, nd, False), kernel_size, stride, padding, dilation, ceil_mode)
        if indices.dtype != dtypes.int64:
            raise OperatorError(f"{op}: indices must be int64, got {indices.dtype}")
        return _gradient(op, grad, w, lambda at, r, flat: eq(indices[at], flat), indices.shape, grad.dtype)

    def with_offsets(x, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False):
        w = _Windows(offsets_name, *_split(offsets_name, x, nd, True), kernel_size, stride, padding, dilation,
                     ceil_mode)
        if math.prod(w.kernel) > MAX_OFFSETS:
            raise OperatorError(f"{offsets_name}: a window of {math.prod(w.kernel)} elements is more than an "
                                f"int8 offset names ({MAX_OFFSETS})")
        return _maxima(offsets_name, nd, x, kernel_size, stride, padding, dilation, ceil_mode, dtypes.int8,
                       lambda w, r, o: _linear(w, r))

    def offsets_backward(grad, offsets, input_size, kernel_size, stride, padding, dilation, ceil_mode):
        op = f"max_pool{nd}d_offsets_backward"
        size = tuple(input_size)
        w = _Windows(op, size[:-nd], size[-nd:], kernel_size, stride, padding, dilation, ceil_mode)
        if offsets.dtype != dtypes.int8:
            raise OperatorError(f"{op}: offsets must be int8, got {offsets.dtype}")
        return _gradient(op, grad, w, lambda at, r, flat: eq(cast(offsets[at], dtypes.int64), _linear(w, r)),
                         offsets.shape, grad.dtype)

    forward.__doc__ = (f"torch.nn.functional.max_pool{nd}d with return_indices=True: (values, "
                       "int64 flat positions of the maxima over the input's spatial dims).")
    backward.__doc__ = (f"The gradient of max_pool{nd}d_with_indices' values with respect to its "
                        "input, given the positions it returned.")
    with_offsets.__doc__ = (f"max_pool{nd}d's values and, for each, the int8 offset of its maximum within "
                            "its window (row-major over the kernel).")
    offsets_backward.__doc__ = (f"The gradient of max_pool{nd}d_with_offsets' values with respect to its "
                                "input, of size `input_size`, given the offsets it returned.")
    named = [(forward, name), (backward, name + "_backward"), (with_offsets, offsets_name),
             (offsets_backward, f"max_pool{nd}d_offsets_backward")]
    for fn, fn_name in named:
        fn.__name__ = fn.__qualname__ = fn_name
    return tuple(operator(fn_name)(fn) for fn, fn_name in named)


(max_pool1d_with_indices, max_pool1d_with_indices_backward, max_pool1d_with_offsets,
 max_pool1d_offsets_backward) = _define(1)
(max_pool2d_with_indices, max_pool2d_with_indices_backward, max_pool2d_with_offsets,
 max_pool2d_offsets_backward) = _define(2)
(max_pool3d_with_indices, max_pool3d_with_indices_backward, max_pool3d_with_offsets,
 max_pool3d_offsets_backward) = _define(3)
