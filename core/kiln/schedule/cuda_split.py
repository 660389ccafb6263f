"""The auto-scheduler's split-reduction rule: reductions of too few elements to fill the GPU
with a block each, each reducing many values (full reductions; batch-norm statistics over N, H
and W of an NCHW tensor, whose values lie in runs of H * W), in two passes.

The first kernel splits each element's reduction across parts, a block each, so that the grid
has about TARGET_BLOCKS blocks, writing partial results to a temporary; the second reduces the
partials (an ordinary reduction buffer). The task's other buffers get the general kernel.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

from kiln.ir.compute import Compute
from kiln.ir.expr import Expr, Load, Reduce, Var, top_reduces
from kiln.ir.inline import Lowered, own_children, rebuild_expr
from kiln.runtime.cuda import CudaProgram
from kiln.codegen.emitter import numel
from kiln.ir.size import SymSize
from kiln.schedule.cuda_kernels import (BLOCK, TARGET_BLOCKS, AutoProgram, Kernel, buffer_kernel, reduce_extent,
                                        symbolic_extent)

MIN_PART = 16 * BLOCK           # values a part reduces, at the least (16 a thread): a reduction
                                # splits where it has two parts of this many or more
SYMBOLIC_ELEMENTS, SYMBOLIC_EXTENT, SYMBOLIC_PARTS = 64, 1 << 16, 512


class SplitPlan(NamedTuple):
    """A buffer's reduction and how many parts its values split into."""

    reduce: Reduce
    parts: int


def split_plan(buf: Compute) -> SplitPlan | None:
    """The plan of `buf`'s reduction when `buf` has fewer elements than half
    of TARGET_BLOCKS, each reducing at least two parts of MIN_PART values; else None. With
    symbolic sizes, whose one source serves every size of a regime, the parts cannot follow
    the size: SYMBOLIC_PARTS of them, for at most SYMBOLIC_ELEMENTS elements reducing
    SYMBOLIC_EXTENT values or more (at the trace's sizes)."""
    reduces = top_reduces(buf.value)
    items = numel(buf.shape)
    if len(reduces) != 1 or not items or items >= TARGET_BLOCKS // 2:
        return None
    r = reduces[0]
    if r.op in ("argmax", "argmin") or any(isinstance(a.extent, Expr) for a in r.axes):
        return None
    extent = reduce_extent(r)
    if symbolic_extent(r) or any(isinstance(s, SymSize) for s in buf.shape):
        return SplitPlan(r, SYMBOLIC_PARTS) if items <= SYMBOLIC_ELEMENTS and extent >= SYMBOLIC_EXTENT else None
    parts = min(-(-TARGET_BLOCKS // items), extent // MIN_PART)
    return SplitPlan(r, parts) if parts >= 2 else None


def replace_node(e: Expr, target: Expr, replacement: Expr) -> Expr:
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
    part = Var("s", parts)
    partials = Reduce(r.op, [part], Load(partial, [flat_index(buf), part]), r.dtype)
    return Compute(buf.name, buf.axes, replace_node(buf.value, r, partials))


def flat_index(buf: Compute) -> Expr:
    """The row-major flat index of `buf`'s element, an expression of its axes."""
    flat = 0
    for axis, size in zip(buf.axes, buf.shape):
        flat = flat * size + axis
    return flat


FirstPass = Callable[[AutoProgram, list, Compute, SplitPlan, str, str], Kernel]
"""(program, kernel arguments, buffer, its plan, partials' name, kernel name) -> the kernel
writing the (elements, parts) partial reductions. A rule's plan may carry more than a
SplitPlan's `reduce` and `parts`, for its own first pass."""


def two_pass(lowered: Lowered, plans: list, first_pass: FirstPass, suffix: str) -> CudaProgram | None:
    """The program of `lowered` where each buffer with a plan (a SplitPlan) is written
    in two passes: `first_pass`'s kernel of partial reductions into a temporary, then the
    buffer's ordinary kernel with the reduction replaced by that of its partials. None when no
    buffer has a plan."""
    if not any(plans):
        return None
    auto = AutoProgram(lowered)
    for n, (buf, plan) in enumerate(zip(lowered.buffers, plans)):
        if numel(buf.shape):
            write_split(auto, n, buf, plan, first_pass, suffix)
    return auto.program()


def write_split(auto: AutoProgram, n: int, buf: Compute, plan: SplitPlan | None, first_pass: FirstPass,
                suffix: str) -> None:
    """Add the kernels writing `buf`, the task's n-th buffer: with a plan (a SplitPlan),
    `first_pass`'s kernel of partial reductions into a temporary, then the buffer's ordinary
    kernel with the reduction replaced by that of its partials; without one, its ordinary kernel."""
    out_name = auto.names[id(buf)]
    if plan:
        partial = auto.temporary((numel(buf.shape), plan.parts), plan.reduce.dtype)
        args = auto.available + [(partial.name, partial, False)]
        auto.kernels.append(first_pass(auto, args, buf, plan, partial.name, f"kiln_k{n}_{suffix}"))
        buf = replace_reduce(buf, plan.reduce, partial, plan.parts)
        auto.available = auto.available + [(partial.name, partial, True)]
    auto.write(n, buf, out_name)


def _split_kernel(auto: AutoProgram, args: list, buf: Compute, plan: SplitPlan, out_name: str,
                  kernel_name: str) -> Kernel:
    return buffer_kernel(auto.names, auto.strides, args, buf, out_name, kernel_name, auto.sizes,
                         (plan.parts, reduce_extent(plan.reduce)))


def schedule(lowered: Lowered) -> CudaProgram | None:
    """The program of `lowered` with its full reductions split; None when it has none."""
    return two_pass(lowered, [split_plan(buf) for buf in lowered.buffers], _split_kernel, "split")
