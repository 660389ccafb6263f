"""Convolutions in float16/bfloat16 as implicit GEMM on tensor cores (sm_80+).

The task is seen as a GEMM through the core's load hooks (`kiln.codegen.hooks.match_hooked_gemm`:
m enumerates output pixels, n output channels, k input channels x kernel taps; im2col and the
zero padding are computed on the fly). A block computes a BM x BN tile with warps of WM x WN
tiles. Each k-step of BK = 32 is read into registers through the hooks, eight neighbouring k
per thread packed into one 16-byte store into a k-major, XOR-swizzled shared-memory tile
(matmul_tc's layout, so `ldmatrix` and the stores do not conflict on banks), double-buffered:
the next step is read while the current one is multiplied by `mma.sync.m16n8k16` into float32
accumulators. Outputs go through the epilogue hook (bias, activation, cast).

Small GEMMs (batch 1, late layers: M = 49) would leave most multiprocessors idle, so K is split
over SPLIT blocks (`kiln_ops_builtin.templates.split_k`: float32 partials, then a kernel that
adds them and applies the epilogue). Knobs (`ConvTcKnobs`) at 0 are chosen from the problem size.

The device code is `cuda/conv_tc.cuh`: `kiln::conv_tc::run`, a C++ template over the element
type and the tile, taking M, N, K and the split as run-time values; the kernel rendered here calls
it with the core's load hooks and split_k's stores. The warp's MMA step is
`cuda/mma_sync.cuh`'s, shared with matmul_tc.

Symbolic sizes (`Template.symbolic`): a symbolic batch (so M) is a kernel argument
(`HookedGemm.sizes`); the knobs chosen from M and N take their bucket (`split_k.bucket`), so
the batches of a bucket share one source.
"""
from __future__ import annotations

from dataclasses import dataclass

from kiln.template import (CudaProgram, Knobs, Launch, Template, as_dim, device_code, dtypes, match_hooked_gemm, ptx,
                           template_source)

from kiln_ops_builtin.templates import split_k

BK = 32
BLOCKS_WANTED = 128          # about one wave of blocks on current data-centre GPUs
TILES = [(128, 128, 64, 64), (128, 64, 64, 32), (64, 128, 32, 64), (64, 64, 32, 32)]   # (BM, BN, WM, WN), largest first
SMALL_M_TILE = (32, 64, 16, 32)

ELEMENTS = {dtypes.float16: "F16", dtypes.bfloat16: "BF16"}       # kiln::mma_sync's element types

# The kernel: cuda/conv_tc.cuh's kiln::conv_tc::run on this task's hooks (the core's load hooks;
# kiln_store, kiln_store2: `split_k`'s, the core's epilogue where K is not split). The shared
# tiles are the kernel's own, so that their symbols name it.
KERNEL = """
extern "C" __global__ void __launch_bounds__({threads}) kiln_conv_tc(PARAMS) {{
    __shared__ __align__(128) uint16_t As[2][{bm} * {bk}];
    __shared__ __align__(128) uint16_t Bs[2][{bn} * {bk}];
    kiln::conv_tc::run<kiln::mma_sync::{elem}, {bm}, {bn}, {bk}, {wm}, {wn}>(
        As, Bs, [&] {{ return kiln::conv_tc::Problem{{M, N, K, KT_SPLIT}}; }},
        [&](int64_t m, int64_t k) {{ return kiln_load_a(ARGS, m, k); }},
        [&](int64_t k, int64_t n) {{ return kiln_load_b(ARGS, k, n); }},
        [&](int64_t m, int64_t n, float v) {{ kiln_store(KERNEL_ARGS, blockIdx.y, 0, m, n, v); }},
        [&](int64_t m, int64_t n, float v0, float v1) {{ kiln_store2(KERNEL_ARGS, blockIdx.y, 0, m, n, v0, v1); }});
}}
"""


def valid_tile(BM: int, BN: int, WM: int, WN: int) -> bool:
    """Whether a tile makes a launchable kernel: whole warp tiles of 16 x 16 multiples, 2 to 8
    warps, and whole 16-byte copies per thread."""
    if min(BM, BN, WM, WN) <= 0 or BM % WM or BN % WN or WM % 16 or WN % 16:
        return False
    nt = (BM // WM) * (BN // WN) * 32
    return 64 <= nt <= 256 and (BM * BK // 8) % nt == 0 and (BN * BK // 8) % nt == 0


@dataclass(frozen=True)
class ConvTcKnobs(Knobs):
    """A BM x BN block tile of WM x WN warp tiles (all 0: `auto_tile`'s for the problem), K
    split SPLIT ways over blocks (0: `auto_split`'s)."""

    BM: int = 0
    BN: int = 0
    WM: int = 0
    WN: int = 0
    SPLIT: int = 0

    def valid(self) -> bool:
        tile = (self.BM, self.BN, self.WM, self.WN)
        return (tile == (0, 0, 0, 0) or valid_tile(*tile)) and self.SPLIT >= 0

    @classmethod
    def space(cls, level: int) -> list[ConvTcKnobs]:
        """Level 0: tile and split chosen from the problem size; level 1 adds each tile with the
        automatic split; level 2 adds splits of 1, 2, 4 and 8 for each tile."""
        tiles = [dict(zip(("BM", "BN", "WM", "WN"), t)) for t in TILES + [SMALL_M_TILE]]
        out = [cls()]
        if level >= 1:
            out += [cls(**t) for t in tiles]
        if level >= 2:
            out += [cls(**t, SPLIT=s) for t in tiles for s in (1, 2, 4, 8)]
        return out


def _tiles(M: int, N: int, tile) -> int:
    return -(-M // tile[0]) * -(-N // tile[1])


def auto_tile(M: int, N: int) -> tuple[int, int, int, int]:
    """The largest tile that gives about a wave of blocks with at most a quarter of it past
    the GEMM's edges; the smallest otherwise (a 32-row tile where M fits in it)."""
    for tile in TILES:
        blocks = _tiles(M, N, tile)
        if blocks >= BLOCKS_WANTED and M * N >= 0.75 * blocks * tile[0] * tile[1]:
            return tile
    return SMALL_M_TILE if M <= 32 else TILES[-1]


def auto_split(blocks: int, k_steps: int) -> int:
    """K split in powers of two while the grid stays within about a wave and each part keeps
    at least four k-steps."""
    split = 1
    while blocks * split * 2 <= BLOCKS_WANTED and k_steps >= split * 2 * 4:
        split *= 2
    return split


def _operand_dtype(task):
    """The one 16-bit float type of the task's inputs, or None."""
    found = {t.dtype for t in task.inputs}
    return found.pop() if len(found) == 1 and found <= set(dtypes.HALF_FLOATS) else None


def applies(task) -> bool:
    g = match_hooked_gemm(task)
    return (g is not None and g.acc_dtype == dtypes.float32 and _operand_dtype(task) is not None
            and max(g.M, g.N, g.K) < 2 ** 31)


def render(task, **knobs) -> CudaProgram:
    """The program of `task` at the setting `knobs` (`ConvTcKnobs`' fields)."""
    g = match_hooked_gemm(task)
    k = ConvTcKnobs(**knobs)
    M, N = split_k.bucket(g.M), split_k.bucket(g.N)
    BM, BN, WM, WN = (k.BM, k.BN, k.WM, k.WN) if k.BM else auto_tile(M, N)
    nt = (BM // WM) * (BN // WN) * 32
    k_steps = -(-g.K // BK)
    split = k.SPLIT or auto_split(_tiles(M, N, (BM, BN)), k_steps)
    per_split = -(-k_steps // split)
    split = -(-k_steps // per_split)          # no empty parts
    temporaries = []
    sk = split_k.plan(split, g.M, g.N, g.K, BK, 1, g.params, tuple(g.args.split(", ")), temporaries, text=g.text)
    dtype = _operand_dtype(task)
    # what split_k's code reads: sizes, ARGS (split_k's own: KT_SPLIT, BATCH, PARAMS, KERNEL_ARGS)
    defines = {"M": g.text(g.M), "N": g.text(g.N), "K": g.text(g.K), "ARGS": g.args, **sk.defines}
    kernel = KERNEL.format(threads=nt, bm=BM, bn=BN, bk=BK, wm=WM, wn=WN, elem=ELEMENTS[dtype])
    source = template_source([device_code(__package__, "cuda/mma_sync.cuh", "cuda/conv_tc.cuh"), sk.stores, kernel,
                              sk.source], defines, g.hooks, (ptx.LDMATRIX, ptx.MMA))
    launch = Launch("kiln_conv_tc", tuple(g.args.split(", ")) + sk.args, (nt, 1, 1),
                    grid=(as_dim(_tiles(g.M, g.N, (BM, BN))), split, 1))
    return CudaProgram(source, [launch] + sk.launches, temporaries, alignment=16, sizes=g.sizes.values)


TEMPLATE = Template("conv_tc", ("conv1d", "conv2d", "conv_transpose2d", "conv2d_channels_last"), "cuda", render,
                    priority=20, applies=applies, space=ConvTcKnobs.settings,
                    symbolic=True)
