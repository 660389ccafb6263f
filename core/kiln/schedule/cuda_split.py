"""The auto-scheduler's split-reduction rule: full reductions (few elements, each reducing
very many values) in two passes.

The first kernel splits each element's reduction across SPLIT_PARTS blocks writing partial
results to a temporary; the second reduces the partials (an ordinary reduction buffer). The
task's other buffers get the general kernel.
"""
from __future__ import annotations

from typing import Callable

from kiln.ir.compute import Compute
from kiln.ir.expr import Expr, Load, Reduce, Var, top_reduces
from kiln.ir.inline import Lowered, own_children, rebuild_expr
from kiln.runtime.cuda import CudaProgram
from kiln.codegen.emitter import numel
from kiln.schedule.cuda_kernels import AutoProgram, Kernel, buffer_kernel, reduce_extent

SPLIT_MIN_EXTENT = 1 << 16      # a reduction this long over few elements is split
SPLIT_PARTS = 512


def split_plan(buf: Compute) -> tuple[Reduce, int] | None:
    """(the reduction, how many parts it splits into) when `buf` is a full reduction worth
    splitting, else None."""
    reduces = top_reduces(buf.value)
    if len(reduces) != 1 or numel(buf.shape) > 64:
        return None
    r = reduces[0]
    if r.op in ("argmax", "argmin") or any(isinstance(a.extent, Expr) for a in r.axes):
        return None
    if reduce_extent(r) < SPLIT_MIN_EXTENT:
        return None
    return r, SPLIT_PARTS


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
    partials = Reduce(r.op, [part], Load(partial, [flat, part]), r.dtype)
    return Compute(buf.name, buf.axes, _replace(buf.value, r, partials))


FirstPass = Callable[[AutoProgram, list, Compute, Reduce, int, str, str], Kernel]
"""(program, kernel arguments, buffer, its reduction, parts, partials' name, kernel name) -> the
kernel writing the (elements, parts) partial reductions."""


def two_pass(lowered: Lowered, plans: list, first_pass: FirstPass, suffix: str) -> CudaProgram | None:
    """The program of `lowered` where each buffer with a plan (its reduction, parts) is written
    in two passes: `first_pass`'s kernel of partial reductions into a temporary, then the
    buffer's ordinary kernel with the reduction replaced by that of its partials. None when no
    buffer has a plan."""
    if not any(plans):
        return None
    auto = AutoProgram(lowered)
    for n, (buf, plan) in enumerate(zip(lowered.buffers, plans)):
        if not numel(buf.shape):
            continue
        out_name = auto.names[id(buf)]
        if plan:
            r, parts = plan
            partial = auto.temporary((numel(buf.shape), parts), r.dtype)
            args = auto.available + [(partial.name, partial, False)]
            auto.kernels.append(first_pass(auto, args, buf, r, parts, partial.name, f"kiln_k{n}_{suffix}"))
            buf = replace_reduce(buf, r, partial, parts)
            auto.available = auto.available + [(partial.name, partial, True)]
        auto.write(n, buf, out_name)
    return auto.program()


def _split_kernel(auto: AutoProgram, args: list, buf: Compute, r: Reduce, parts: int, out_name: str,
                  kernel_name: str) -> Kernel:
    return buffer_kernel(auto.names, auto.strides, args, buf, out_name, kernel_name, auto.sizes,
                         (parts, reduce_extent(r)))


def schedule(lowered: Lowered) -> CudaProgram | None:
    """The program of `lowered` with its full reductions split; None when it has none."""
    return two_pass(lowered, [split_plan(buf) for buf in lowered.buffers], _split_kernel, "split")
