"""Skinny matrix products on the tensor cores: matmul and linear with 5 to 16 rows per batch
(decoding a batch of sequences), float16 and bfloat16.

Like `gemv`'s, such a product is a stream over B (a linear layer's weight): each of its elements
is used M times, too few for the GEMM templates' 64-row tiles, and `gemv`'s M loads of A per
vector of B dominate past four rows. Here the roles swap: B's rows are the rows of an
mma.sync.m16n8k16 and A's (up to 16: one or two n8 tiles) its columns, so each warp owns 16
columns n of the output and streams their rows of B once in 16-byte vectors, every lane's
vector a slice of two mma k-steps (the sum over k is order-free, so A's fragments take the same
k from A's rows). KW warps of a block split K between them and add through shared memory; SPLIT
> 1 splits K over blocks as well, for grids that would not fill the GPU, as `gemv` does (its
module doc): in a thread-block cluster with CLUSTER (sm_90, SPLIT <= 8, one kernel), else through
split-K's workspace and sum kernel. The core's epilogue hooks write each element (bias,
activations, casts fused as everywhere).

Declines (`gemv` takes M <= 4, the GEMM templates the rest): M outside 5 to 16 or symbolic (a
source per M would be a build per size), dtypes other than float16 and bfloat16, an operand
whose K is not contiguous, K or a stride not a multiple of 8 (`gemv.reads_vectors`).

The device code is `cuda/gemv_tc.cuh`: `kiln::gemv_tc::run`, a C++ template over the element
type, M and the knobs (`GemvTcKnobs`), taking N, K and the strides as run-time arguments; the
rendered kernel calls it through split_k's `kiln_split_k_tiles`, as `gemv`'s does.

Symbolic sizes (`Template.symbolic`): N, K, strides and batch dims are kernel arguments; M sizes
the fragments, so each M has its own source (a symbolic M is declined). `suggest` buckets symbolic sizes by powers of two.
"""
from __future__ import annotations

from dataclasses import dataclass

from kiln.template import Contraction, CudaProgram, Knobs, SymSize, Template, dtypes, match_contraction, ptx
from kiln_ops_builtin.templates import gemv, split_k

MIN_M, MAX_M = 5, 16
COLUMNS = 16            # output columns a warp owns: the mma's rows
GROUP = 32              # elements of K a lane group takes per step: two mma k-steps
ELEMENTS = {dtypes.float16: "F16", dtypes.bfloat16: "BF16"}     # kiln::gemv_tc's types

KERNEL = """
extern "C" __global__ void __launch_bounds__({threads}) kiln_gemv_tc(PARAMS) {{
    const int64_t bz = blockIdx.z;
    const kiln::gemv_tc::Problem problem = {{{n}, {k}, {a_stride}, {b_stride}, KT_SPLIT}};
    kiln_split_k_tiles<{rows}, {columns}>(problem.n, [&](int64_t tile, int split, auto store) {{
        kiln::gemv_tc::run<kiln::gemv_tc::{elem}, {rows}, {k_warps}, {warps}, {prefetch}>(
            (const uint16_t*){a} + ({a_batch}), (const uint16_t*){b} + ({b_batch}), problem, tile, split, store);
    }}, [&](int split, int m, int64_t n, float v) {{ kiln_store(KERNEL_ARGS, split, bz, m, n, v); }});
}}
"""


@dataclass(frozen=True)
class GemvTcKnobs(Knobs):
    """K split over KW of a block's WARPS warps and over SPLIT blocks; PREFETCH steps of each
    thread's B brought into L2 before the kernel waits for the kernel ahead of it (as `gemv`'s,
    whose module doc says why that is safe; 0 by default until measured). Sixteen warps
    splitting K in a block stream as much of B at once as eight in each of two blocks, without
    split-K's partials and sum kernel. CLUSTER: the SPLIT blocks of a tile add their partials in
    a thread-block cluster (sm_90, SPLIT <= 8) instead of split-K's sum kernel."""

    KW: int = 4
    SPLIT: int = 1
    PREFETCH: int = 0
    WARPS: int = gemv.WARPS
    CLUSTER: bool = False

    def valid(self) -> bool:
        return (self.WARPS in (8, 16) and self.KW in (1, 2, 4, 8, 16) and self.KW <= self.WARPS
                and self.SPLIT >= 1 and 0 <= self.PREFETCH <= 8 and gemv.clusters_valid(self))

    def min_arch(self) -> int:
        return gemv.cluster_arch(self)

    @classmethod
    def space(cls, level: int) -> list[GemvTcKnobs]:
        """Level 0: K split over four warps (where no GPU is asked for `suggest`); 1 every
        K-warps count; 2 adds split-K over blocks (through the sum kernel and, on sm_90, in
        clusters), sixteen warps a block and B's first steps prefetched."""
        if level == 0:
            return [cls()]
        if level < 2:
            return cls.grid(KW=(1, 2, 4, 8))
        return (cls.grid(KW=(1, 2, 4, 8)) + cls.grid(KW=(8,), SPLIT=(2, 4, 8)) + cls.grid(KW=(16,), WARPS=(16,))
                + cls.grid(KW=(4, 8), PREFETCH=(1,)) + cls.grid(KW=(8,), SPLIT=(2, 4, 8), CLUSTER=(True,)))


def applies(task) -> bool:
    c = match_contraction(task)
    if (c is None or c.a.dtype != c.b.dtype or c.a.dtype not in ELEMENTS or isinstance(c.M, SymSize)
            or not MIN_M <= c.M <= MAX_M):
        return False
    return gemv.reads_vectors(c)


def suggest(task, sm_count: int) -> list[dict]:
    """The warps and split `gemv.fit` to the shape (a warp's step: a 32-element group of K), the
    split in clusters first (`gemv.suggestions`)."""
    c = match_contraction(task)
    N, K, batch = (split_k.bucket(x) for x in (c.N, c.K, c.batch_count))
    kw, split = gemv.fit(N, -(-K // GROUP), batch, COLUMNS, sm_count)
    return gemv.suggestions(GemvTcKnobs(KW=kw, SPLIT=split))


def render(task, **knobs) -> CudaProgram:
    """The program of `task` at the setting `knobs` (`GemvTcKnobs`' fields)."""
    c: Contraction = match_contraction(task)
    k = GemvTcKnobs(**knobs)
    groups = (c.K + GROUP - 1) // GROUP
    split = max(1, min(k.SPLIT, int(groups)))
    columns = k.WARPS // k.KW * COLUMNS
    kernel = KERNEL.format(threads=32 * k.WARPS, elem=ELEMENTS[c.a.dtype], columns=columns, k_warps=k.KW,
                           warps=k.WARPS, prefetch=k.PREFETCH, **gemv.operands(c))
    return gemv.stream_program(c, "kiln_gemv_tc", "cuda/gemv_tc.cuh", kernel, groups, split, k.CLUSTER and split > 1,
                               k.WARPS, columns, k.PREFETCH, (ptx.MMA,))


TEMPLATE = Template("gemv_tc", ("matmul", "linear", "dft"), "cuda", render, priority=40, applies=applies,
                    space=GemvTcKnobs.settings, suggest=suggest, knob_arch=GemvTcKnobs.setting_arch, reads_views=True,
                    symbolic=True)
