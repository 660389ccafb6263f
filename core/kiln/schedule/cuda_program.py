"""What a CUDA schedule produces: one source, the kernels to launch in order, and temporaries.

Both the auto-scheduler and the templates return a `CudaProgram`; `kiln.schedule.cuda` builds
and launches it. Kernel arguments are named buffers: `in0..`, `out0..` (the task's inputs and
outputs) and `tmp0..` (temporaries allocated from PyTorch's allocator for each run).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kiln.dtypes import DataType


@dataclass(frozen=True)
class Launch:
    """One kernel launch.

    Either `grid` is fixed, or the grid covers `items` work items at `per_block` per block,
    capped at `waves` blocks per multiprocessor (the kernel loops over what remains).
    """

    kernel: str
    args: tuple[str, ...]
    block: tuple[int, int, int]
    grid: tuple[int, int, int] | None = None
    items: int = 0
    per_block: int = 1
    waves: int = 16
    smem: int = 0

    def grid_for(self, sm_count: int) -> tuple[int, int, int]:
        """The grid to launch on a GPU with `sm_count` multiprocessors."""
        if self.grid is not None:
            return self.grid
        blocks = -(-self.items // self.per_block)
        return (max(1, min(blocks, sm_count * self.waves)), 1, 1)


@dataclass
class CudaProgram:
    """CUDA C++ source with its launches; `arch_suffix` 'a' asks for sm_90a-only features.
    Inputs and outputs at addresses that are not multiples of `alignment` (a view at an odd
    offset, say) go through aligned copies."""

    source: str
    launches: list[Launch]
    temporaries: list[tuple[tuple[int, ...], DataType]] = field(default_factory=list)
    arch_suffix: str = ""
    min_arch: int = 80
    alignment: int = 1       # bytes every input and output pointer must be a multiple of

    @property
    def kernel_names(self) -> list[str]:
        return list(dict.fromkeys(launch.kernel for launch in self.launches))

    @property
    def max_smem(self) -> int:
        return max((launch.smem for launch in self.launches), default=0)
