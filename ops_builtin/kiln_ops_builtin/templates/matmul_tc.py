"""Matmul, batched matmul and linear in float16/bfloat16 on tensor cores (sm_80+).

A block computes a BM x BN tile of the output with warps of WM x WN tiles; K advances BK at a
time through a STAGES-deep ring of shared-memory tiles filled by `cp.async` (16-byte copies,
zero-filled past the matrix edges). Fragments load with `ldmatrix` (`.trans` for a row-major
[K, N] operand) from XOR-swizzled tiles, so that neither the copies nor `ldmatrix` conflict on
banks; `mma.sync.m16n8k16` accumulates in float32. Each output element goes through the core's
epilogue hook (`kiln.codegen.hooks`), so bias, activation and the final cast are fused there;
with split-K (`kiln_ops_builtin.templates.split_k`) through the sum kernel's.

The device code is `cuda/mma_sync.cuh` (the warp's MMA step, shared with conv_tc; the element
types), `cuda/matmul_tc.cuh` (the knobs as `kiln::matmul_tc::Tile`, an operand) and
`cuda/matmul_tc_kernel.cuh` (the kernel, on them); between them this module renders
`kiln_matmul_tc_program`: the knobs, the element type, B's layout and each operand of a batch (a
pointer and strides). M, N, K and the split are split_k's, run-time values where symbolic;
results go to split_k's stores. Knobs: `TcKnobs`, whose fields' defaults are the level-0 setting.

Symbolic sizes (`Template.symbolic`): M, N, K, strides and batch dims are kernel arguments
(`Contraction.sizes`); `suggest` buckets them by powers of two (`split_k.bucket`), so the sizes
of a bucket share one source.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

from kiln.template import (Contraction, CudaProgram, Knobs, Launch, Template, as_dim, device_code, dtypes, match_contraction,
                           ptx, template_source)
from kiln_ops_builtin.templates import split_k

MAX_SMEM = 227 * 1024
ELEMENTS = {dtypes.float16: "F16", dtypes.bfloat16: "BF16"}       # kiln::mma_sync's element types

# What cuda/matmul_tc_kernel.cuh's kernel reads of a program: the knobs (kiln::matmul_tc::Tile),
# the element type, B's layout, and a(ARGS, bz), b(ARGS, bz): each operand of batch bz. An
# operand with a batch offset takes bz by reference, one without by value, unnamed: the machine
# code is then the one of the offset written in the kernel (by value, an offset is computed at
# another place; by reference where no offset reads it, split-K's stores add in another order).
PROGRAM = """
struct kiln_matmul_tc_program {{
    using Tile = kiln::matmul_tc::Tile<{bm}, {bn}, {bk}, {wm}, {wn}, {stages}, {group}>;
    using Elem = kiln::mma_sync::{elem};
    enum {{ B_K_CONTIGUOUS = {b_k_contiguous} }};
    static __device__ __forceinline__ {a}
    static __device__ __forceinline__ {b}
}};
"""
OPERAND = ("kiln::matmul_tc::Operand {name}({params}, {bz}) {{ "
           "return {{(const uint16_t*){param} + ({batch}), {xs}, {ks}}}; }}")


def smem_bytes(BM: int, BN: int, BK: int, STAGES: int) -> int:
    """The dynamic shared memory of a block: STAGES k-tiles of both operands."""
    return STAGES * (BM + BN) * BK * 2


def valid_tile(BM: int, BN: int, BK: int, WM: int, WN: int, STAGES: int) -> bool:
    """Whether a tile makes a launchable kernel: whole warp tiles of 16 x 16 multiples, 2 to 8
    warps, whole 16-byte copies per thread, shared memory that fits, at least two stages."""
    if min(BM, BN, BK, WM, WN) <= 0 or BM % WM or BN % WN or WM % 16 or WN % 16:
        return False
    nt = (BM // WM) * (BN // WN) * 32
    return (64 <= nt <= 256 and (BM * BK // 8) % nt == 0 and (BN * BK // 8) % nt == 0
            and smem_bytes(BM, BN, BK, STAGES) <= MAX_SMEM and STAGES >= 2)


@dataclass(frozen=True)
class TcKnobs(Knobs):
    """A BM x BN block tile of WM x WN warp tiles (2 to 8 warps), k-tiles of BK in a ring of
    STAGES shared-memory stages, tiles handed out in groups of GROUP rows of tiles (sharing B's
    column tiles in L2), K split SPLIT ways over blocks. The defaults are level 0: 128 x 128 x 32
    tiles of 64 x 64 warp tiles, four stages."""

    BM: int = 128
    BN: int = 128
    BK: int = 32
    WM: int = 64
    WN: int = 64
    STAGES: int = 4
    GROUP: int = 8
    SPLIT: int = 1

    @property
    def threads(self) -> int:
        """A block's threads: a warp a warp tile."""
        return (self.BM // self.WM) * (self.BN // self.WN) * 32

    def valid(self) -> bool:
        return valid_tile(self.BM, self.BN, self.BK, self.WM, self.WN, self.STAGES) and self.GROUP >= 1 \
            and self.SPLIT >= 1

    @classmethod
    def space(cls, level: int) -> list[TcKnobs]:
        """Level 0: the default; 1: a few tile shapes and split-K; 2: tiles x warp tiles x depths."""
        if level == 0:
            return [cls()]
        if level == 1:
            return [cls(), cls(BN=256, STAGES=3), cls(BM=256, STAGES=3), cls(BM=64, WM=32), cls(BK=64, STAGES=3),
                    SPLIT_PROBE]
        out = []
        for bm, bn, bk, (wm, wn), st in itertools.product((64, 128, 256), (64, 128, 256), (32, 64),
                                                           ((64, 64), (32, 64), (64, 32)), (3, 4, 5)):
            if bm * bn >= 128 * 64 and valid_tile(bm, bn, bk, wm, wn, st):
                out.append(cls(BM=bm, BN=bn, BK=bk, WM=wm, WN=wn, STAGES=st))
        return out


SPLIT_PROBE = TcKnobs(BM=64, BN=64, WM=32, WN=32, SPLIT=2)
FIT_TILES = [split_k.Tile(k.as_dict(), k.BM, k.BN, k.BK, 1024)
             for k in (TcKnobs(), TcKnobs(BN=64, WN=32), TcKnobs(BM=64, WM=32), TcKnobs(BM=64, BN=64, WM=32, WN=32))]
"""`suggest`'s tiles, at mma.sync's 1024 float16 MACs per SM clock (half of wgmma's)."""


def applies(task) -> bool:
    c = match_contraction(task)
    return (c is not None and c.a.dtype in dtypes.HALF_FLOATS and c.a.dtype == c.b.dtype
            and c.a.k_contiguous and c.K % 8 == 0 and (c.b.k_contiguous or (c.b.x_contiguous and c.N % 8 == 0))
            and c.a.strides_multiple_of(8) and c.b.strides_multiple_of(8))


def suggest(task, sm_count: int) -> list[dict]:
    """Tiles and split-K ranked by `split_k`'s cost model for this shape (symbolic sizes by
    their bucket)."""
    c = match_contraction(task)
    return split_k.rank(FIT_TILES, *(split_k.bucket(x) for x in (c.M, c.N, c.K, c.batch_count)), sm_count, 2)


def render(task, **knobs) -> CudaProgram:
    """The program of `task` at the setting `knobs` (`TcKnobs`' fields)."""
    c: Contraction = match_contraction(task)
    k = TcKnobs(**knobs)
    args, temporaries = tuple(c.args.split(", ")), []
    sk = split_k.plan(k.SPLIT, c.M, c.N, c.K, k.BK, c.batch_count, c.params, args, temporaries, text=c.text)
    operands = [OPERAND.format(name=name, params=c.params, param=op.param, batch=batch,
                               bz="int64_t" if batch == "0" else "const int64_t& bz",
                               xs=f"(int64_t){c.text(op.x_stride)}", ks=f"(int64_t){c.text(op.k_stride)}")
                for name, op in (("a", c.a), ("b", c.b)) for batch in [c.batch_offset(op, "bz")]]
    program = PROGRAM.format(bm=k.BM, bn=k.BN, bk=k.BK, wm=k.WM, wn=k.WN, stages=k.STAGES, group=k.GROUP,
                             elem=ELEMENTS[c.a.dtype], b_k_contiguous=int(c.b.k_contiguous), a=operands[0],
                             b=operands[1])
    # what split_k's code and the kernel read: sizes, ARGS (split_k's own: KT_SPLIT, BATCH, PARAMS, KERNEL_ARGS)
    defines = {"M": c.text(c.M), "N": c.text(c.N), "K": c.text(c.K), "ARGS": c.args, **sk.defines}
    source = template_source([device_code(__package__, "cuda/mma_sync.cuh", "cuda/matmul_tc.cuh"), program, sk.stores,
                              device_code(__package__, "cuda/matmul_tc_kernel.cuh"), sk.source], defines, c.epilogue,
                             (ptx.CP_ASYNC, ptx.LDMATRIX, ptx.MMA))
    tiles = as_dim(-(-c.M // k.BM) * -(-c.N // k.BN))
    launch = Launch("kiln_matmul_tc", args + sk.args, (k.threads, 1, 1), grid=(tiles, k.SPLIT, as_dim(c.batch_count)),
                    smem=smem_bytes(k.BM, k.BN, k.BK, k.STAGES))
    return CudaProgram(source, [launch, *sk.launches], temporaries, alignment=16, sizes=c.sizes.values)


TEMPLATE = Template("matmul_tc", ("matmul", "linear", "dft"), "cuda", render, priority=10, applies=applies,
                    space=TcKnobs.settings, suggest=suggest, reads_views=True, symbolic=True)
