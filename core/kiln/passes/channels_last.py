"""Operators on NCHW data run on channels-last (NHWC) data, through their own definitions.

`in_channels_last(op)` is an operator taking its first argument as (N, H, W, C) and giving
its 4-D result as (N, OH, OW, OC): its compute definition is `op`'s, applied to a view of the
input (element (n, c, h, w) read at [n, h, w, c]) with the result's axes reordered. The view
is inlined and the reduction, if any, stays in the one output compute, so the kernel reads
and writes channels-last memory directly: a pooling or a batch norm in a channels-last region
needs no conversions around it.

    pool = in_channels_last(registry().operator("max_pool2d"))
    y = pool(x_nhwc, [], (), (("kernel_size", 3), ("stride", 2), ("padding", 1)))
"""
from __future__ import annotations

import functools

from kiln.graph import OperatorDef, OperatorError
from kiln.ir import Compute, Var, compute, substitute

NCHW_TO_NHWC = (0, 2, 3, 1)    # permute dims taking (N, C, H, W) to (N, H, W, C)
NHWC_TO_NCHW = (0, 3, 1, 2)    # and back


def permuted_shape(shape, order) -> tuple:
    """`shape` after a permute by `order` (output dim k is input dim order[k])."""
    return tuple(shape[k] for k in order)


@functools.lru_cache(maxsize=None)
def in_channels_last(op: OperatorDef) -> OperatorDef:
    """`op` on channels-last data: called as `(x, operands, operand_names, attributes)`, where
    `x` is the (N, H, W, C) input taking the place of `op`'s first argument, `operands` the
    other tensor arguments, named by `operand_names`, and `attributes` the other arguments as
    (name, value) pairs. `op` must give one 4-D result."""

    def definition(x, operands, operand_names, attributes):
        if x.ndim != 4:
            raise OperatorError(f"{name}: expected a 4-D channels-last input (N, H, W, C), got {x.shape}")
        view = compute(permuted_shape(x.shape, NHWC_TO_NCHW),
                       lambda n, c, h, w: x[n, h, w, c], name="nchw_view")
        result = op.definition(view, **dict(zip(operand_names, operands)), **dict(attributes))
        if not isinstance(result, Compute) or result.ndim != 4:
            raise OperatorError(f"{name}: {op.name} must give one 4-D result to run channels-last")
        axes = [Var(f"i{k}", s) for k, s in enumerate(permuted_shape(result.shape, NCHW_TO_NHWC))]
        nchw_axes = permuted_shape(axes, NHWC_TO_NCHW)
        value = substitute(result.value, {id(a): b for a, b in zip(result.axes, nchw_axes)})
        return Compute(result.name, axes, value)

    name = f"{op.name}_channels_last"
    return OperatorDef(name, definition, display_name=f"{op.display_name}ChannelsLast")
