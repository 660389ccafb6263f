"""The auto-scheduler's split-reduction rule: full reductions (few elements, each reducing
very many values) in two passes.

The first kernel splits each element's reduction across SPLIT_PARTS blocks writing partial
results to a temporary; the second reduces the partials (an ordinary reduction buffer). The
task's other buffers get the general kernel.
"""
from __future__ import annotations

from kiln.codegen.cuda import top_reduces
from kiln.ir.compute import Compute
from kiln.ir.expr import Expr, Load, Reduce, Var
from kiln.ir.inline import Lowered, own_children, rebuild_expr
from kiln.runtime.cuda import CudaProgram
from kiln.codegen.emitter import numel
from kiln.schedule.cuda_kernels import AutoProgram, buffer_kernel, reduce_extent

SPLIT_MIN_EXTENT = 1 << 16      # a reduction this long over few elements is split
SPLIT_PARTS = 512


def split_plan(buf: Compute) -> tuple[int, int] | None:
    """(parts, extent) when `buf` is a full reduction worth splitting, else None."""
    reduces = top_reduces(buf.value)
    if len(reduces) != 1 or numel(buf.shape) > 64:
        return None
    r = reduces[0]
    if r.op in ("argmax", "argmin") or any(isinstance(a.extent, Expr) for a in r.axes):
        return None
    extent = reduce_extent(r)
    if extent < SPLIT_MIN_EXTENT:
        return None
    return (SPLIT_PARTS, extent)


def _replace(e: Expr, target: Reduce, replacement: Expr) -> Expr:
    """`e` with the node `target` replaced by `replacement`."""
    memo = {}

    def visit(x):
        if x is target:
            return replacement
        if id(x) in memo:
            return memo[id(x)]
        kids = own_children(x) if not isinstance(x, (Var, Load)) else None
        if isinstance(x, Load):
            out = Load(x.tensor, [visit(i) for i in x.indices])
        elif kids:
            out = rebuild_expr(x, [visit(k) for k in kids])
        else:
            out = x
        memo[id(x)] = out
        return out

    return visit(e)


def replace_reduce(buf: Compute, r: Reduce, partial, parts: int) -> Compute:
    """`buf` with its reduction `r` replaced by the same reduction of the `parts` partial results
    in `partial` (one row of them per element of `buf`, row-major)."""
    flat = 0
    for axis, size in zip(buf.axes, buf.shape):
        flat = flat * size + axis
    part = Var("s", parts)
    return Compute(buf.name, buf.axes, _replace(buf.value, r, Reduce(r.op, [part], Load(partial, [flat, part]), r.dtype)))


def schedule(lowered: Lowered) -> CudaProgram | None:
    """The program of `lowered` with its full reductions split; None when it has none."""
    plans = [split_plan(buf) for buf in lowered.buffers]
    if not any(plans):
        return None
    auto = AutoProgram(lowered)
    for n, (buf, plan) in enumerate(zip(lowered.buffers, plans)):
        if not numel(buf.shape):
            continue
        out_name = auto.names[id(buf)]
        if plan:
            r = top_reduces(buf.value)[0]
            partial = auto.temporary((numel(buf.shape), plan[0]), r.dtype)
            args = auto.available + [(partial.name, partial, False)]
            auto.kernels.append(buffer_kernel(auto.names, auto.strides, args, buf, partial.name,
                                              f"kiln_k{n}_split", auto.sizes, plan))
            buf = replace_reduce(buf, r, partial, plan[0])
            auto.available = auto.available + [(partial.name, partial, True)]
        auto.write(n, buf, out_name)
    return auto.program()
