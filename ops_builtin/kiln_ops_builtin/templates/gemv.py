"""Matrix-vector products: matmul and linear with at most 4 rows per batch (decoding).

With M <= 4 a GEMM is a stream over B: each of its elements is used M times, so the kernel's
speed is the memory bandwidth at which it reads B, and tensor-core tiles of 64 rows would waste
most of their work. Each warp owns R columns n (rows of a linear layer's weight, contiguous
along K), its lanes stride over K in 16-byte vectors, and the M rows of A ride along: every
loaded vector of B is multiplied by the M matching vectors of A (small, cached) into M x R float32
accumulators. KW warps of a block split K between them and add through shared memory. SPLIT > 1
splits K over blocks as well, for grids that would not fill the GPU (`split_k`): with CLUSTER
(sm_90, SPLIT <= 8) the SPLIT blocks of a tile of columns run as one thread-block cluster and
add their float32 partials through distributed shared memory, each block then storing a slice of
the tile, in one kernel; without, the partials go to a workspace and a second kernel adds them.
`suggest` ranks the cluster form first where it applies, and a GPU older than sm_90 is offered
the other (`Template.knob_arch`). A warp-shuffle sum ends each column, and the core's epilogue
hooks write it (bias, activations, casts fused as everywhere).

With PREFETCH > 0 each thread first brings the B vectors of its first PREFETCH steps into L2
and only then waits for the kernels ahead of it (`CudaProgram.waiting`; the runtime's wait is
otherwise a kernel's first statement, `kiln.runtime.dependent_launch`). A prefetch reads nothing
into the thread and L2 is where every SM's writes meet, so it is safe whatever B is; and B, a
linear layer's weight in a decoding step, then streams while the kernel ahead (a norm, an
attention, which leave the memory idle) still runs.

Declines: M > 4 (on an H200 at M = 16 this kernel reached 0.22-0.5 of cuBLAS: the M loads of A
per vector of B dominate; `gemv_tc` takes 5 to 16 rows of 16-bit floats on the tensor cores, the
GEMM templates the rest), an operand whose K is not contiguous, K or a
stride not a multiple of one 16-byte vector, dtypes other than float16, bfloat16 and float32.

The device code is `cuda/gemv.cuh`: `kiln::gemv::run`, a C++ template over the element type,
M and the knobs (`GemvKnobs`), taking N, K and the strides as run-time arguments. The kernel
rendered here calls it with this task's operands and sizes through split_k's
`kiln_split_k_tiles` (which block computes which tile and split, and where its results go),
and stores through the epilogue hook.

Symbolic sizes (`Template.symbolic`): N, K, strides and batch dims are kernel arguments
(`Contraction.sizes`); M sizes the accumulator arrays, so each M (1 to 4) has its own source.
`suggest` buckets symbolic sizes by powers of two (`split_k.bucket`). The cluster form takes
symbolic sizes as the other does: only the grid's length along x and KT_SPLIT depend on them.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from kiln.template import (Contraction, CudaProgram, Knobs, Launch, Template, as_dim, device_code, dtypes, match_contraction,
                           ptx, template_source)
from kiln_ops_builtin.templates import split_k

MAX_M = 4
WARPS = 8
MAX_GRID_Z = 65535
ELEMENTS = {dtypes.float16: "F16", dtypes.bfloat16: "BF16", dtypes.float32: "F32"}    # kiln::gemv's types

# The kernel: cuda/gemv.cuh's kiln::gemv::run on this task's operands, in split_k's blocks, each
# column stored by the epilogue hook (kiln_store: `split_k`'s, the core's kiln_epilogue where K is
# not split or the splits meet in a cluster).
KERNEL = """
extern "C" __global__ void __launch_bounds__({threads}) kiln_gemv(PARAMS) {{
    const int64_t bz = blockIdx.z;
    using Elem = kiln::gemv::{elem};
    const kiln::gemv::Problem problem = {{{n}, {k}, {a_stride}, {b_stride}, KT_SPLIT}};
    kiln_split_k_tiles<{rows}, {columns}>(problem.n, [&](int64_t tile, int split, auto store) {{
        kiln::gemv::run<Elem, {rows}, {cols}, {k_warps}, {warps}, {prefetch}>(
            (const Elem::storage*){a} + ({a_batch}), (const Elem::storage*){b} + ({b_batch}), problem, tile, split,
            store);
    }}, [&](int split, int m, int64_t n, float v) {{ kiln_store(KERNEL_ARGS, split, bz, m, n, v); }});
}}
"""


@dataclass(frozen=True)
class GemvKnobs(Knobs):
    """R columns per warp, K split over KW warps of a block and over SPLIT blocks; PREFETCH
    steps of each thread's B brought into L2 before the kernel waits for the kernel ahead of it
    (see the module doc; 0 by default until measured); CLUSTER: the SPLIT blocks of a tile add
    their partials in a thread-block cluster (sm_90, SPLIT <= 8) instead of split-K's sum
    kernel."""

    R: int = 2
    KW: int = 4
    SPLIT: int = 1
    PREFETCH: int = 0
    CLUSTER: bool = False

    def valid(self) -> bool:
        return (self.R in (1, 2, 4) and self.KW in (1, 2, 4, 8) and self.SPLIT >= 1 and 0 <= self.PREFETCH <= 8
                and clusters_valid(self))

    def min_arch(self) -> int:
        return cluster_arch(self)

    @classmethod
    def space(cls, level: int) -> list[GemvKnobs]:
        """Level 0: two columns per warp, K split over four warps (where no GPU is asked for
        `suggest`); 1 and 2 add columns per warp, K split over a block's warps and over blocks,
        and (2) B's first steps prefetched."""
        if level == 0:
            return [cls()]
        out = cls.grid(R=(1, 2, 4), KW=(1, 2, 4, 8))
        if level < 2:
            return out
        return (out + cls.grid(R=(1, 2), KW=(8,), SPLIT=(2, 4, 8)) + cls.grid(KW=(4, 8), PREFETCH=(2,))
                + cls.grid(R=(1, 2), KW=(8,), SPLIT=(2, 4, 8), CLUSTER=(True,)))


def clusters_valid(knobs: Knobs) -> bool:
    """Whether a `GemvKnobs` or `GemvTcKnobs` setting's CLUSTER is one the kernel runs: a
    cluster holds 2 to `split_k.MAX_CLUSTER` splits."""
    return not knobs.CLUSTER or split_k.clusters(knobs.SPLIT)


def cluster_arch(knobs: Knobs) -> int:
    """The lowest architecture of a `GemvKnobs` or `GemvTcKnobs` setting: 90 for clusters."""
    return 90 if knobs.CLUSTER else 0


def suggestions(first: Knobs) -> list[dict]:
    """`suggest`'s ranking around `first`, a `GemvKnobs` or `GemvTcKnobs` setting: the same in
    clusters where its split allows (which only sm_90 is offered), `first`, then the rest of its
    level-1 space."""
    clustered = [replace(first, CLUSTER=True)] if split_k.clusters(first.SPLIT) else []
    head = [k.as_dict() for k in (*clustered, first)]
    return head + [k for k in type(first).settings(1) if k not in head]


def _vec(c: Contraction) -> int:
    return 16 // c.a.dtype.nbytes


def reads_vectors(c: Contraction) -> bool:
    """Whether both operands of `c` are read in 16-byte vectors along K: contiguous along K,
    K and every row and batch stride whole vectors, and a batch count the grid's z takes (the
    layout `gemv` and `gemv_tc` stream)."""
    vec = _vec(c)
    return (c.K % vec == 0 and c.a.k_contiguous and c.b.k_contiguous and c.batch_count <= MAX_GRID_Z
            and all(s % vec == 0 for op in (c.a, c.b) for s in (op.x_stride, *op.batch_strides)))


def fit(N: int, steps: int, batch: int, columns: int, sm_count: int) -> tuple[int, int]:
    """(KW, SPLIT) for a grid of blocks of WARPS warps, each warp owning `columns` of the N
    columns (times `batch`), whose K takes `steps` steps of one warp: the fewest K-splitting
    warps that still give two blocks per SM; split over blocks when even eight do not fill one
    wave, at least two steps per warp and split."""
    blocks = lambda kw: -(-N // (WARPS // kw * columns)) * batch
    kw = next((k for k in (1, 2, 4) if blocks(k) >= 2 * sm_count), 8)
    split = min(-(-sm_count // blocks(kw)), steps // (kw * 2))
    return kw, split if blocks(kw) < sm_count and split > 1 else 1


def applies(task) -> bool:
    c = match_contraction(task)
    if c is None or c.a.dtype != c.b.dtype or c.a.dtype not in ELEMENTS or not 0 < c.M <= MAX_M:
        return False
    return reads_vectors(c)


def suggest(task, sm_count: int) -> list[dict]:
    """Two columns per warp, the warps and split `fit` to the shape (a warp's step: a vector
    per lane), the split in clusters first (`suggestions`)."""
    c = match_contraction(task)
    N, K, batch = (split_k.bucket(x) for x in (c.N, c.K, c.batch_count))
    r = 2
    kw, split = fit(N, K // _vec(c) // 32, batch, r, sm_count)
    return suggestions(GemvKnobs(R=r, KW=kw, SPLIT=split))


def operands(c: Contraction) -> dict:
    """The fields of a `gemv` or `gemv_tc` kernel's text that place its operands: N, K, the
    rows' strides, M, and each operand's buffer and batch offset (for the flat batch `bz`)."""
    return dict(n=c.text(c.N), k=c.text(c.K), a_stride=c.text(c.a.x_stride), b_stride=c.text(c.b.x_stride),
                rows=int(c.M), a=c.a.param, a_batch=c.batch_offset(c.a, "bz"), b=c.b.param,
                b_batch=c.batch_offset(c.b, "bz"))


def stream_program(c: Contraction, name: str, device: str, kernel: str, steps: int, split: int, cluster: bool,
                   warps: int, columns: int, prefetch: int, wrappers: tuple[str, ...] = ()) -> CudaProgram:
    """The program of `gemv`'s or `gemv_tc`'s kernel `name` (its rendered text `kernel`, after the
    device code file `device` and the PTX `wrappers` it needs): blocks of `warps` warps, each
    block owning `columns` of the N columns, K in `steps` steps split `split` ways over blocks,
    whose partials meet in a thread-block cluster with `cluster` (`split_k`, sm_90); with
    `prefetch`, the kernel waits for the kernels ahead of it itself (`CudaProgram.waiting`, see
    the module doc). Its kernels (and split-K's sum) are `streaming`: the next kernel launches
    right after their wait (`kiln.runtime.dependent_launch`)."""
    args, temporaries = tuple(c.args.split(", ")), []
    sk = split_k.plan(split, c.M, c.N, steps, 1, c.batch_count, c.params, args, temporaries, text=c.text,
                      cluster=cluster)
    defines = {"M": int(c.M), "N": c.text(c.N), "ARGS": c.args, **sk.defines}     # what split_k's code reads
    tiles, batch = as_dim(-(-c.N // columns)), as_dim(c.batch_count)
    launch = Launch(name, args + sk.args, (32 * warps, 1, 1), grid=(tiles * split, 1, batch) if cluster else
                    (tiles, split, batch), cluster=split if cluster else 1)
    source = template_source([device_code(__package__, device), sk.stores,
                              device_code(__package__, "cuda/split_k_tiles.cuh"), kernel, sk.source],
                             defines, c.epilogue, (*wrappers, ptx.PRIOR_GRIDS, ptx.PREFETCH_L2, ptx.DSMEM))
    launches = [launch, *sk.launches]
    return CudaProgram(source, launches, temporaries, min_arch=90 if cluster else 80, alignment=16,
                       sizes=c.sizes.values, waiting=(name,) if prefetch else (),
                       streaming=tuple(l.kernel for l in launches))


def render(task, **knobs) -> CudaProgram:
    """The program of `task` at the setting `knobs` (`GemvKnobs`' fields)."""
    c: Contraction = match_contraction(task)
    k = GemvKnobs(**knobs)
    chunks = c.K // _vec(c)
    split = max(1, min(k.SPLIT, chunks))
    columns = WARPS // k.KW * k.R
    kernel = KERNEL.format(threads=32 * WARPS, elem=ELEMENTS[c.a.dtype], columns=columns, cols=k.R, k_warps=k.KW,
                           warps=WARPS, prefetch=k.PREFETCH, **operands(c))
    return stream_program(c, "kiln_gemv", "cuda/gemv.cuh", kernel, chunks, split, k.CLUSTER and split > 1, WARPS,
                          columns, k.PREFETCH)


TEMPLATE = Template("gemv", ("matmul", "linear", "dft"), "cuda", render, priority=40, applies=applies,
                    space=GemvKnobs.settings, suggest=suggest, knob_arch=GemvKnobs.setting_arch, reads_views=True,
                    symbolic=True)
