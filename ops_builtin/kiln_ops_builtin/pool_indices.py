"""Max pooling with the positions of its maxima, and the gradient that flows back through them.

`max_pool{1,2,3}d_with_indices` return torch's pair: the pooled values and, for each, the flat
position (over the input's spatial dims) of the first largest element of its window. Padding
never wins: where a window holds only the lowest value, the position is the window's first
in-bounds element, as in torch's kernels. `max_pool{n}d_with_indices_backward` gathers rather
than scatters: each input element sums the output gradients of the windows that contain it and
chose it (at most prod(kernel) candidates), so it needs no atomics and is deterministic. Where a
window holds several NaNs, the position is the first (torch's kernels take the last).
"""
from __future__ import annotations

import math

from kiln import dtypes
from kiln.graph import OperatorError, operator
from kiln.ir import cast, compute, eq, maximum, reduce, select

from kiln_ops_builtin.common import accumulator_type, check_dtype, in_bounds
from kiln_ops_builtin.pool import _lowest, _max_pool, _Windows


def _first_in_bounds(w: _Windows, start, d: int):
    """The first window position along dim `d` at or after 0 (a window may start in the padding)."""
    skipped = maximum(-start, 0)
    return start + (skipped + w.dilation[d] - 1) // w.dilation[d] * w.dilation[d]


def _max_positions(op, nd, x, kernel_size, stride, padding, dilation, ceil_mode):
    w = _Windows(op, x, nd, True, kernel_size, stride, padding, dilation, ceil_mode)
    low = _lowest(x.dtype)
    nl = len(w.lead)

    def position(*i):
        lead, o = i[:nl], i[nl:]
        p = reduce(w.kernel, lambda *r: w.read(x, lead, o, r, low), op="argmax")
        flat = 0
        for d in range(nd):
            start = w.start(o, d)
            r = p // math.prod(w.kernel[d + 1:]) % w.kernel[d]
            flat = flat * w.size[d] + maximum(start + r * w.dilation[d], _first_in_bounds(w, start, d))
        return flat

    return compute(w.lead + tuple(w.out), position, dtype=dtypes.int64)


def _with_indices(op, nd, x, kernel_size, stride, padding, dilation, ceil_mode):
    args = (x, kernel_size, stride, padding, dilation, ceil_mode)
    return _max_pool(op, nd, *args), _max_positions(op, nd, *args)


def _backward(op, nd, grad, x, kernel_size, stride, padding, dilation, ceil_mode, indices):
    w = _Windows(op, x, nd, False, kernel_size, stride, padding, dilation, ceil_mode)
    check_dtype(op, grad, dtypes.FLOATS)
    expected = w.lead + tuple(w.out)
    if tuple(grad.shape) != expected or tuple(indices.shape) != expected:
        raise OperatorError(f"{op}: grad_output {grad.shape} and indices {indices.shape} must both "
                            f"have the pooled shape {expected} of input {x.shape}")
    if indices.dtype != dtypes.int64:
        raise OperatorError(f"{op}: indices must be int64, got {indices.dtype}")
    acc = accumulator_type(grad.dtype)
    nl = len(w.lead)

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
            return select(ok, select(eq(indices[at], flat), cast(grad[at], acc), 0), 0)

        return cast(reduce(w.kernel, contribution, dtype=acc), grad.dtype)

    return compute(tuple(x.shape), element, dtype=grad.dtype)


def _define(nd: int):
    name = f"max_pool{nd}d_with_indices"

    def forward(x, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False):
        return _with_indices(name, nd, x, kernel_size, stride, padding, dilation, ceil_mode)

    def backward(grad, x, kernel_size, stride, padding, dilation, ceil_mode, indices):
        return _backward(name + "_backward", nd, grad, x, kernel_size, stride, padding, dilation,
                         ceil_mode, indices)

    forward.__doc__ = (f"torch.nn.functional.max_pool{nd}d with return_indices=True: (values, "
                       "int64 flat positions of the maxima over the input's spatial dims).")
    backward.__doc__ = (f"The gradient of max_pool{nd}d_with_indices' values with respect to its "
                        "input, given the positions it returned.")
    forward.__name__ = forward.__qualname__ = name
    backward.__name__ = backward.__qualname__ = name + "_backward"
    return operator(name)(forward), operator(name + "_backward")(backward)


max_pool1d_with_indices, max_pool1d_with_indices_backward = _define(1)
max_pool2d_with_indices, max_pool2d_with_indices_backward = _define(2)
max_pool3d_with_indices, max_pool3d_with_indices_backward = _define(3)
