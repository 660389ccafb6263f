"""GEMM-shaped tasks in float32 on the CUDA cores (no TF32): matmul, batched matmul, linear,
and convolutions as implicit GEMM.

A block of 256 threads (8 warps) computes a BM x BN output tile; each warp a WM x WN part of
it, and each thread of a warp a TM x TN sub-tile made of 4-row x 4-column pieces spread over
the warp's tile (the lanes form a 4 x 8 grid, or 8 x 4 where WM > WN), so that the 16-byte
shared-memory reads of a k-step are broadcasts of at most 128 distinct bytes: free of bank
conflicts. K advances BK at a time (over a share of K with split-K,
`kiln_ops_builtin.templates.split_k`) through a ring of STAGES shared-memory stages, one
`__syncthreads` a k-tile: while k-tile t is multiplied, the copies of t + STAGES - 1 are in
flight (cp.async groups, waited `STAGES - 2` deep; a register-staged operand holds one k-tile
in registers across the FMAs and stores it into its stage after them). With FRAG, each thread
reads the next k-step's fragments (its float4s of A and B) into a second register set while
the current k-step's FMAs run, the first k-step of the next k-tile included (read right after
the barrier, before the last k-step's FMAs). With FRAG the 128 x 128 tile keeps two blocks an
SM (128 registers, no spills, 2 to 4 stages, ptxas for sm_90), without it three stages spill
16 bytes. Shared memory is static, at most 48 KB (`render` refuses more), so 128 x 128 x 16
tiles take two stages. Both operands are stored k-major in shared memory, rows padded by 4 floats; an operand that is k-contiguous in
memory (A, or B of `linear`) is read into registers (float4s along k where sizes allow) and
transposed on the way in, the padding keeping those stores free of bank conflicts; an operand
contiguous along m or n is copied by `cp.async` straight into shared memory when ASYNC (else
through registers too). Each thread's copies walk their operand by pointers that advance a
k-tile at a time, the 64-bit offsets computed once. Tiles are handed out in groups of
GROUP_M rows of tiles, so that blocks running together share their operands in L2.

A convolution's operands are read through the core's load hooks
(`kiln.codegen.hooks.match_hooked_gemm`: im2col computed on the fly, padding included), a
scalar at a time. Outputs go through the core's epilogue hook.

The device code is `cuda/matmul_simt.cuh` (the knobs as `kiln::matmul_simt::Tile`, the operands'
kinds `Plain<KC, W, Async>` and `Hooked`, their copies) and `cuda/matmul_simt_kernel.cuh` (the
kernel, on them); between the two this module renders `kiln_matmul_simt_program`: the knobs,
the operands' kinds and how each operand is read (a pointer and strides, or the core's load
hook). M, N, K and the split are split_k's, run-time values where symbolic; results go to
split_k's stores. Knobs: `SimtKnobs`, whose fields' defaults are the level-0 setting.

Symbolic sizes (`Template.symbolic`): M, N, K, strides and batch dims are kernel arguments
(`Contraction.sizes`, `HookedGemm.sizes`); `suggest` buckets them by powers of two
(`split_k.bucket`), so the sizes of a bucket share one source.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from kiln.template import (Contraction, CudaProgram, HookedGemm, Knobs, Launch, Operand, Template, as_dim, device_code, dtypes,
                           match_contraction, match_hooked_gemm, ptx, template_source)
from kiln_ops_builtin.templates import split_k

NT = 256
MAX_SMEM = 48 * 1024

# What cuda/matmul_simt_kernel.cuh's kernel reads of a program: the knobs (kiln::matmul_simt::Tile),
# the operands' kinds, and a(ARGS, ...), b(ARGS, ...): each operand as its kind takes it (a
# pointer and strides of batch bz, or the core's load hook).
PROGRAM = """
struct kiln_matmul_simt_program {{
    using Tile = kiln::matmul_simt::Tile<{bm}, {bn}, {bk}, {wm}, {wn}, {min_blocks}, {stages}, {frag}>;
    using A = kiln::matmul_simt::{a_kind};
    using B = kiln::matmul_simt::{b_kind};
    static __device__ __forceinline__ {a}
    static __device__ __forceinline__ {b}
}};
"""
PLAIN = ("kiln::matmul_simt::Operand {name}({params}, const int64_t& bz) {{ return {{{param} + ({batch}), {xs}, {ks}}}; "
         "}}")
HOOKED = ("float a({params}, int64_t x, int64_t k) {{ return kiln_load_a(ARGS, (x), (k)); }}",
          "float b({params}, int64_t x, int64_t k) {{ return kiln_load_b(ARGS, (k), (x)); }}")


def smem_bytes(bm: int, bn: int, bk: int, stages: int) -> int:
    """The shared memory of a block: STAGES k-tiles of both operands, rows padded by 4 floats."""
    return stages * bk * (bm + 4 + bn + 4) * 4


def lanes(wm: int, wn: int) -> tuple[int, int]:
    """The LM x LN grid of a warp's lanes over its WM x WN tile (kiln::matmul_simt::Tile's)."""
    return (8, 4) if wm > wn else (4, 8)


def thread_tile(bm: int, bn: int, wm: int, wn: int) -> tuple[int, int] | None:
    """A thread's TM x TN sub-tile, or None where the knobs make no valid layout (8 warps of
    WM x WN tiling BM x BN, sub-tiles of whole 4 x 4 pieces)."""
    lm, ln = lanes(wm, wn)
    if bm % wm or bn % wn or (bm // wm) * (bn // wn) != NT // 32 or wm % (4 * lm) or wn % (4 * ln):
        return None
    return wm // lm, wn // ln


@dataclass(frozen=True)
class SimtKnobs(Knobs):
    """A BM x BN block tile of 8 WM x WN warp tiles, k-tiles of BK; MIN_BLOCKS blocks an SM
    (`__launch_bounds__`); ASYNC: an operand contiguous along m or n copied by cp.async (else
    through registers); STAGES k-tiles in flight; FRAG: fragments double buffered; K split SPLIT
    ways over blocks. The defaults are level 0: 128 x 256 x 8 tiles of 64 x 64 warp tiles, one
    block an SM, fragments double buffered (what `suggest` gives large GEMMs whose operand comes
    by cp.async)."""

    BM: int = 128
    BN: int = 256
    BK: int = 8
    WM: int = 64
    WN: int = 64
    MIN_BLOCKS: int = 1
    ASYNC: int = 1
    STAGES: int = 2
    FRAG: int = 1
    SPLIT: int = 1

    def problem(self) -> str | None:
        """Why the kernel cannot take this setting, or None."""
        if thread_tile(self.BM, self.BN, self.WM, self.WN) is None or self.BK % 8 or (self.BM * self.BK) % NT \
                or (self.BN * self.BK) % NT:
            return f"invalid matmul_simt knobs {self.BM}x{self.BN}x{self.BK}, warp tile {self.WM}x{self.WN}"
        if self.STAGES < 2 or self.FRAG not in (0, 1):
            return f"invalid matmul_simt knobs STAGES={self.STAGES} (2 or more), FRAG={self.FRAG} (0 or 1)"
        if smem_bytes(self.BM, self.BN, self.BK, self.STAGES) > MAX_SMEM:
            return (f"matmul_simt knobs BM={self.BM}, BN={self.BN}, BK={self.BK}, STAGES={self.STAGES} need "
                    f"{smem_bytes(self.BM, self.BN, self.BK, self.STAGES)} bytes of shared memory, over the "
                    f"{MAX_SMEM} of a kernel's static shared memory")
        if self.MIN_BLOCKS < 1 or self.ASYNC not in (0, 1) or self.SPLIT < 1:
            return f"invalid matmul_simt knobs MIN_BLOCKS={self.MIN_BLOCKS}, ASYNC={self.ASYNC}, SPLIT={self.SPLIT}"
        return None

    def __post_init__(self):
        if self.problem() is not None:
            raise ValueError(self.problem())

    def valid(self) -> bool:
        return self.problem() is None

    @classmethod
    def space(cls, level: int) -> list[SimtKnobs]:
        """Level 0: the defaults; level 1 adds the 128 x 128 tile of two blocks an SM with FRAG
        (`ASYNC_PIPELINE`'s), the other warp shape, a deeper k-step, one block an SM (what
        `suggest` gives the load hooks), register-staged copies only, smaller tiles, the 128 x
        128 tile over 2 to 4 stages with and without FRAG, another 128 x 256 warp shape and a
        split-K probe; level 2 more combinations of them."""
        out = [cls()]
        if level >= 1:
            out += [replace(WIDE, MIN_BLOCKS=2, FRAG=1), replace(WIDE, WM=64, WN=32), replace(WIDE, BK=16), WIDE,
                    replace(WIDE, ASYNC=0), TILE_128x64, TILE_64x128, replace(WIDE, MIN_BLOCKS=2)]
            out += [replace(WIDE, MIN_BLOCKS=2, STAGES=s, FRAG=f) for s, f in ((3, 0), (3, 1), (4, 1))]
            out += [replace(WIDE, STAGES=3, FRAG=1), cls(WM=32, WN=128, STAGES=3)]
        if level >= 2:
            out += [replace(WIDE, BK=16, WM=64, WN=32), replace(WIDE, BK=16, MIN_BLOCKS=2),
                    replace(WIDE, WM=64, WN=32, MIN_BLOCKS=2), replace(WIDE, BK=16, ASYNC=0),
                    replace(TILE_128x64, BK=16), replace(TILE_64x128, BK=16), replace(TILE_64x64, BK=8),
                    replace(TILE_64x64, WM=32, WN=16), replace(TILE_128x64, WM=64, WN=16),
                    replace(WIDE, WM=64, WN=32, MIN_BLOCKS=2, STAGES=3, FRAG=1), replace(WIDE, BK=16, FRAG=1)]
            out += [replace(t, STAGES=3, FRAG=1) for t in (TILE_128x64, TILE_64x128, TILE_64x64)]
            out += [cls(BM=256, BN=128), cls(BM=256, BN=128, WM=128, WN=32), cls(STAGES=3)]
        if level >= 1:
            out.append(SPLIT_PROBE)
        return out


WIDE = SimtKnobs(BM=128, BN=128, WM=32, WN=64, FRAG=0)
"""The 128 x 128 tile of 32 x 64 warp tiles, one block an SM, fragments read as used (what
`suggest` gives the load hooks); level 1 and 2 vary it."""
TILE_64x128 = SimtKnobs(BM=64, BN=128, WM=32, WN=32, MIN_BLOCKS=2, FRAG=0)
TILE_128x64 = replace(TILE_64x128, BM=128, BN=64)
TILE_64x64 = replace(TILE_64x128, BN=64, BK=16, WM=16)
"""The smaller tiles, two blocks an SM (`suggest` splits them over K where tiles are few)."""
SPLIT_PROBE = replace(TILE_64x64, SPLIT=2)


def _fit_tile(knobs: SimtKnobs, max_split: int = split_k.MAX_SPLIT) -> split_k.Tile:
    """A tile for `suggest`: 128 FMAs per SM clock, less the shared-memory reads a thread's
    TM x TN FMAs wait on (TM + TN per k)."""
    tm, tn = thread_tile(knobs.BM, knobs.BN, knobs.WM, knobs.WN)
    return split_k.Tile(knobs.as_dict(), knobs.BM, knobs.BN, knobs.BK, 128 * tm * tn / (tm * tn + tm + tn), max_split)


SMALL_TILES = [_fit_tile(t) for t in (TILE_64x128, TILE_128x64, TILE_64x64)]
"""64 x 128 first: on an H100 it beat 128 x 64 on every BERT linear where the model ties them
(1024 x 768 x 768 0.811 of cuBLAS against 0.754, 128 x 3072 x 768 2.03 against 1.69)."""
FIT_TILES = [_fit_tile(WIDE), SMALL_TILES[1], SMALL_TILES[0], SMALL_TILES[2]]
"""Through the load hooks (convolutions) the 128 x 128 tile spills at two blocks an SM."""
ASYNC_PIPELINE = {"STAGES": 2, "FRAG": 1}
"""The plain 128 x 128 tile's pipeline where an operand is copied by cp.async (x @ W): on an
H100, 4096^3 0.825 -> 0.887 of cuBLAS."""
STAGED_PIPELINE = {"STAGES": 3, "FRAG": 0}
"""... where both operands go through registers (x @ W.T): 0.760 -> 0.828 (with FRAG, below 0.77)."""
ASYNC_FIT_TILES, STAGED_FIT_TILES = ([_fit_tile(replace(WIDE, MIN_BLOCKS=2, **pipeline), max_split=1)] + SMALL_TILES
                                     for pipeline in (ASYNC_PIPELINE, STAGED_PIPELINE))
"""Plain operands' 128 x 128 tile runs two blocks an SM (128 registers, no spills): on an H100,
4096^3 float32 0.815 -> 0.833 of cuBLAS, x @ W.T 0.542 -> 0.761. It is not split over K: on
grids of fewer blocks than SMs, 64 x 128 tiles split over K ran faster (1024 x 768 x 768 0.823
of cuBLAS against 0.719 for 128 x 128 split 8 ways, 128 x 768 x 2304 1.32 against 1.19)."""
LARGE_ASYNC_TILE = _fit_tile(SimtKnobs(), max_split=1)
"""Where an operand comes by cp.async, a 128 x 256 tile of 64 x 64 warp tiles (16 x 8 a thread,
one block an SM, 232 registers) ranks first: on an H100, 4096^3 x @ W 0.887 -> 0.928 of cuBLAS
(over 128 x 256 and 256 x 128 tiles, both warp shapes, 2 or 3 stages, with and without FRAG;
x @ W.T stays on 128 x 128, where every larger tile ran below 0.77)."""
ASYNC_FIT_TILES.insert(0, LARGE_ASYNC_TILE)
SUM_BYTES = 32
"""The split-K partials' bytes per SM clock in this template's cost model (`split_k.cost`): half
what the tensor-core templates assume. On an H100, 128 x 768 x 3072 split 8 ways over 64 x 128
tiles ran at 0.75 of cuBLAS against 0.85 for 4 ways, which the default ranked the other way.
Convolutions (the load hooks) are ranked with it too, measured only end to end (float32
ResNet-18 and ResNet-50 at batch 1, `benchmarks/HISTORY.md`)."""


def _gemm(task) -> Contraction | HookedGemm:
    """The GEMM `task` computes: a float32 contraction of plain loads, else through load hooks."""
    c = match_contraction(task)
    return c if c is not None and c.a.dtype == dtypes.float32 else match_hooked_gemm(task)


def suggest(task, sm_count: int) -> list[dict]:
    """Tiles and split-K ranked by `split_k`'s cost model for this shape (symbolic sizes by
    their bucket)."""
    g = _gemm(task)
    plain = isinstance(g, Contraction)
    tiles = FIT_TILES
    if plain:
        tiles = ASYNC_FIT_TILES if any(copy[2] for copy in copies(g, 1)) else STAGED_FIT_TILES
    return split_k.rank(tiles, *(split_k.bucket(x) for x in (g.M, g.N, g.K, g.batch_count if plain else 1)),
                        sm_count, 4, SUM_BYTES)


def _copy(op: Operand, extent, K, use_async: int) -> tuple[int, int, int]:
    """An operand's copies, kiln::matmul_simt::Plain's (KC, W, Async): k-contiguous or not;
    4-wide (W) where every copy can be an aligned float4 along its contiguous dimension (that
    dimension's stride 1 and extent a multiple of 4, every other stride a multiple of 4, buffers
    16-byte aligned), by cp.async where ASYNC and that dimension is m or n."""
    kc = int(op.k_contiguous and not op.x_contiguous)
    vec = (K if kc else extent) % 4 == 0 and op.strides_multiple_of(4) and (op.k_stride if kc else op.x_stride) == 1
    return kc, 4 if vec else 1, int(bool(use_async and vec and not kc))


def copies(c: Contraction, ASYNC: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """A's and B's copies where operands are read straight from memory (float32 matmul, batched
    matmul, linear)."""
    return _copy(c.a, c.M, c.K, ASYNC), _copy(c.b, c.N, c.K, ASYNC)


def applies(task) -> bool:
    c = match_contraction(task)
    if c is not None:
        return c.a.dtype == dtypes.float32 and c.b.dtype == dtypes.float32
    g = match_hooked_gemm(task)
    return g is not None and g.acc_dtype == dtypes.float32


def render(task, **knobs) -> CudaProgram:
    """The program of `task` at the setting `knobs` (`SimtKnobs`' fields)."""
    k = SimtKnobs(**knobs)
    g = _gemm(task)
    if isinstance(g, Contraction):
        batch, hooks = g.batch_count, g.epilogue
        kinds = [f"Plain<{kc}, {w}, {a}>" for kc, w, a in copies(g, k.ASYNC)]
        operands = [PLAIN.format(name=name, params=g.params, param=op.param, batch=g.batch_offset(op, "bz"),
                                 xs=f"(int64_t){g.text(op.x_stride)}", ks=f"(int64_t){g.text(op.k_stride)}")
                    for name, op in (("a", g.a), ("b", g.b))]
    else:
        batch, hooks, kinds = 1, g.hooks, ["Hooked", "Hooked"]
        operands = [h.format(params=g.params) for h in HOOKED]
    names, temporaries = tuple(g.args.split(", ")), []
    sk = split_k.plan(k.SPLIT, g.M, g.N, g.K, k.BK, batch, g.params, names, temporaries, text=g.text)
    # what split_k's code and the kernel read: sizes, ARGS (split_k's own: KT_SPLIT, BATCH, PARAMS, KERNEL_ARGS)
    defines = {"M": g.text(g.M), "N": g.text(g.N), "K": g.text(g.K), "ARGS": g.args, **sk.defines}
    program = PROGRAM.format(bm=k.BM, bn=k.BN, bk=k.BK, wm=k.WM, wn=k.WN, min_blocks=k.MIN_BLOCKS, stages=k.STAGES,
                             frag=k.FRAG, a_kind=kinds[0], b_kind=kinds[1], a=operands[0], b=operands[1])
    tiles = as_dim(-(-g.M // k.BM) * -(-g.N // k.BN))
    launch = Launch("kiln_matmul_simt", names + sk.args, (NT, 1, 1), grid=(tiles, k.SPLIT, as_dim(batch)))
    source = template_source([device_code(__package__, "cuda/matmul_simt.cuh"), program, sk.stores,
                              device_code(__package__, "cuda/matmul_simt_kernel.cuh"), sk.source], defines, hooks,
                             (ptx.CP_ASYNC,))
    return CudaProgram(source, [launch, *sk.launches], temporaries, alignment=16, sizes=g.sizes.values)


TEMPLATE = Template("matmul_simt", ("matmul", "linear", "dft", "conv1d", "conv2d", "conv_transpose2d"), "cuda",
                    render, priority=10, applies=applies, space=SimtKnobs.settings, suggest=suggest, reads_views=True,
                    symbolic=True)
