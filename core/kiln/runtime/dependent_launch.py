"""Programmatic dependent launch (Hopper and later): a kernel starts while the kernel ahead of
it in the stream finishes.

On sm_90 and later, a kernel launched with the driver's programmatic stream serialization
attribute may be scheduled before the kernel ahead of it in its stream has finished: its
blocks start as the earlier kernel's blocks exit, so the gap between two dependent kernels
(launch processing, block scheduling) overlaps the earlier one's tail. CUDA graph capture keeps
these programmatic edges. Such a kernel must wait for the grids before it (`griddepcontrol.wait`:
they have completed and their memory is visible) before it reads or writes global memory;
`with_prior_grid_wait` makes that wait the first statement of every kernel of a source (but
those that wait themselves, after L2 prefetches of their weights: `CudaProgram.waiting`), and the
runtime (`kiln.runtime.cuda.CudaRunner`) launches with the attribute only kernels compiled from
such a source. Right after its wait, each block of a grid of at most one block per
multiprocessor lets the next kernel launch (`griddepcontrol.launch_dependents`): that kernel
starts once every block of this one has, so its blocks take only the places this grid leaves
free, and wait there. A larger grid lets it launch only as its blocks exit: its blocks fill
every multiprocessor until the last wave, and a next kernel launched at their start would land
wherever they free up first, two blocks on one multiprocessor and none on another, which
halves the speed of a GEMM sized to fill the GPU in one wave (BERT's split-K GEMMs after their
sums; benchmarks/RESULTS.md has the A/B). The kernels a program names `streaming`
(`CudaProgram.streaming`: GEMVs and decode attention, whose next kernel is another memory-bound
one that loses nothing to where it lands) let it launch right after their wait whatever their
grid: a decoding step is a chain of short kernels, each best started as soon as the one ahead
ends.
Kernels that PyTorch launches between Kiln's are ordinary launches, ordered as always.

On by default from sm_90; `KILN_DEPENDENT_LAUNCH=0` turns it off. On an H100 (two sessions of
2026-11-26, CUDA graphs on), on against off in one process: float16 ResNet-50 batch 1
1.07-1.26x, GPT-2 1.07-1.09x, MobileNetV3 1.01-1.03x, BERT batch 8 1.00x, EfficientNet-B0
batch 8 0.99-1.00x; float32 ResNet-18 batch 1 1.03x, ResNet-50 batch 1 1.01x.
"""
from __future__ import annotations

import re
from typing import Collection

from kiln.codegen import ptx
from kiln.settings import current

MIN_ARCH = 90

WAIT_HELPER = ptx.PRIOR_GRIDS
WAIT_CALL = " kiln_wait_prior_grids();"
RELEASING_WAIT_CALL = " kiln_wait_prior_grids(true);"
_KERNEL = re.compile(r"\b__global__\b")
_BODY_OR_END = re.compile(r"[{;]")
_NAME = re.compile(r"(\w+)\s*\(")        # a kernel's name: the first such word but __launch_bounds__


def enabled(arch: int) -> bool:
    """Whether kernels for a GPU of compute capability `arch` (90 for sm_90) launch as
    programmatic dependents (sm_90 and later, unless `KILN_DEPENDENT_LAUNCH=0`)."""
    return arch >= MIN_ARCH and current().dependent_launch


def with_prior_grid_wait(source: str, waiting: Collection[str] = (), streaming: Collection[str] = ()) -> str:
    """`source` with `kiln_wait_prior_grids()` as the first statement of every kernel (the
    opening brace after each `__global__`, on the same line, so kernels that macros define
    get it too; `kiln_wait_prior_grids(true)` in the kernels named in `streaming`), but the
    kernels named in `waiting`, which call it themselves after work that reads and writes no
    global memory (`CudaProgram.waiting`: L2 prefetches of constant weights); and the helper
    defined ahead of it. Raises ValueError where a `__global__` has no body."""
    pieces, start = [WAIT_HELPER], 0
    for found in _KERNEL.finditer(source):
        if found.start() < start:
            continue
        body = _BODY_OR_END.search(source, found.end())
        if body is None or body.group() != "{":
            raise ValueError(f"a __global__ without a body at character {found.start()} of a kernel source")
        name = next((n for n in _NAME.findall(source, found.end(), body.start()) if n != "__launch_bounds__"), None)
        pieces += [source[start:body.end()],
                   "" if name in waiting else RELEASING_WAIT_CALL if name in streaming else WAIT_CALL]
        start = body.end()
    return "".join(pieces) + source[start:]
