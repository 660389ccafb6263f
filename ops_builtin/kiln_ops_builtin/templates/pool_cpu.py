"""max_pool2d on the CPU: the windows of `conv_depthwise_cpu`'s kernel with a max in place of the
weighted sum, vectorized along the output's rows.

Each (batch, channel) is copied into phase planes padded with -inf (`cpu/planes.h`), so that for
every tap of the window the inputs of consecutive output columns are consecutive floats of one
plane, for any stride, padding, dilation and ceil_mode; a block of an output row is then the
max over the taps of unaligned vector loads, NaN propagated as the C prelude's max does. The
block goes through the epilogue hook (whatever fusion put after the pool). 16-bit inputs are
converted to float32 in the planes (exactly: the max of converted values is the converted max)
and stored through the epilogue. The template takes a task only where its max is exactly the
max_pool2d definition's on a 4-D float input (`own_task.same_reduction`); sizes are fixed.
"""
from __future__ import annotations

from kiln.template import CpuProgram, Template

from kiln_ops_builtin.pool import _split, _Windows, max_pool2d
from kiln_ops_builtin.templates import conv_depthwise_cpu
from kiln_ops_builtin.templates.conv_cpu import ConvCpu, windowed
from kiln_ops_builtin.templates.own_task import same_reduction

ATTRIBUTES = ("kernel_size", "stride", "padding", "dilation", "ceil_mode")


def match_max_pool(task) -> ConvCpu | None:
    """`task` as a max_pool2d of a 4-D float input (epilogues fused after it), or None."""
    if task.name != "max_pool2d" or not set(ATTRIBUTES) <= set(task.attrs):
        return None
    found = windowed(task, "max", 1)
    if found is None:
        return None
    lowered, (x,), _ = found
    arguments = {name: task.attrs[name] for name in ATTRIBUTES}
    try:
        ref = max_pool2d.definition(x=x, **arguments)
        w = _Windows("max_pool2d", *_split("max_pool2d", x, 2, True), *arguments.values())
    except ValueError:      # an OperatorError is a ValueError
        return None
    out = lowered.outputs[0]
    if not same_reduction([x], out, ref):
        return None
    return ConvCpu(lowered, x, None, w.stride, w.dilation, w.padding, tuple(out.shape), True, w.kernel)


def applies(task) -> bool:
    return match_max_pool(task) is not None


def render(task, **knobs) -> CpuProgram:
    """The program `kiln_kernel(input, output)` for `task` at the setting `knobs`
    (`conv_depthwise_cpu.DepthwiseKnobs`' fields)."""
    c = match_max_pool(task)
    if c is None:
        raise ValueError(f"pool_cpu does not apply to task '{task.name}'")
    return conv_depthwise_cpu.program(c, conv_depthwise_cpu.DepthwiseKnobs(**knobs), True)


TEMPLATE = Template("pool_cpu", ("max_pool2d",), "cpu", render, priority=20, applies=applies,
                    space=conv_depthwise_cpu.DepthwiseKnobs.settings, fixed_sizes_only=True)
