"""Matmul, batched matmul and linear in float16/bfloat16 with Hopper's wgmma (sm_90a).

Each of WG warpgroups computes MI slabs of 64 rows x BN columns with
`wgmma.mma_async.m64n{BN}k16`, both operands read by the tensor cores straight from shared
memory through descriptors. Tiles are BK = 64 elements (128 bytes) deep in the 128-byte-swizzled
K-major layout wgmma expects, filled STAGES deep by `cp.async` (zero-filled past the edges).
An operand that is not K-contiguous in 16-byte aligned rows (a row-major [K, N] weight, K not
a multiple of eight, a strided view) is first staged K-major into a temporary
(`kiln_ops_builtin.templates.stage`). Outputs go through the core's epilogue hooks, or with split-K
(`kiln_ops_builtin.templates.split_k`) through the sum kernel's.

Symbolic sizes (`Template.symbolic`): M, N, K, strides and batch dims are kernel arguments
(`Contraction.sizes`), staged operands' temporaries sized by their values; `suggest` buckets them
by powers of two (`split_k.bucket`), so the sizes of a bucket share one source.

The device code is `cuda/matmul_wgmma.cuh` (the kernel), after split_k's stores; this module
renders `kiln_matmul_wgmma_program` ahead of it: the knobs as enumerators, and the operands' row
strides and batch offsets (`stage.Staged`). Knobs: `WgmmaKnobs`, whose fields' defaults are the
level-0 setting.
"""
from __future__ import annotations

from dataclasses import dataclass

from kiln.template import (Contraction, CudaProgram, Knobs, Launch, Template, as_dim, device_code, dtypes, match_contraction,
                           ptx, template_source)
from kiln_ops_builtin.templates import split_k, stage

BK = 64
MAX_SMEM = 227 * 1024

# What cuda/matmul_wgmma.cuh's kernel reads of a program (bz by reference: by value, NVVM numbers
# the kernel's registers otherwise than before the SDK port, the PTX else the same)
PROGRAM = """
struct kiln_matmul_wgmma_program {{
    enum : int {{ {enums} }};
    static __device__ __forceinline__ int64_t a_row(PARAMS) {{ return {a_row}; }}
    static __device__ __forceinline__ int64_t b_row(PARAMS) {{ return {b_row}; }}
    static __device__ __forceinline__ int64_t a_batch(const int64_t& bz, PARAMS) {{ return {a_batch}; }}
    static __device__ __forceinline__ int64_t b_batch(const int64_t& bz, PARAMS) {{ return {b_batch}; }}
}};
"""


@dataclass(frozen=True)
class WgmmaKnobs(Knobs):
    """WG warpgroups of MI 64-row slabs by BN columns (a multiple of 8 up to 256, wgmma's N, whose
    rows of B the 128 * WG threads copy in whole 16-byte pieces), STAGES k-tiles of shared memory (at least 3: two in flight ahead), K split SPLIT ways
    (`split_k`). The defaults are level 0: 128 x 128 on two warpgroups, four stages."""

    BN: int = 128
    WG: int = 2
    MI: int = 1
    STAGES: int = 4
    SPLIT: int = 1

    @property
    def BM(self) -> int:
        """The tile's rows."""
        return 64 * self.WG * self.MI

    def smem_bytes(self) -> int:
        """The STAGES stages of A and B and 1024 bytes of alignment."""
        return self.STAGES * (self.BM + self.BN) * BK * 2 + 1024

    def valid(self) -> bool:
        return (self.BN % 8 == 0 and 8 <= self.BN <= 256 and self.WG >= 1 and self.MI >= 1 and self.STAGES >= 3
                and self.SPLIT >= 1 and self.BN * 8 % (128 * self.WG) == 0)

    def fits(self) -> bool:
        """Whether the setting fits shared memory (`render` refuses one that does not)."""
        return self.smem_bytes() <= MAX_SMEM

    @classmethod
    def space(cls, level: int) -> list[WgmmaKnobs]:
        """Level 0: 128 x 128 on two warpgroups, 4 stages; 1 and 2: wider tiles, other depths,
        split-K; the shapes that fit shared memory."""
        if level == 0:
            return [cls()]
        shapes = [(128, 2, 1, 4), (256, 2, 1, 4), (128, 1, 2, 4), (256, 2, 1, 5)]
        if level == 2:
            shapes += [(128, 2, 1, 5), (256, 2, 1, 3), (128, 2, 2, 3), (128, 1, 1, 6), (128, 2, 2, 4), (128, 2, 1, 6)]
        tiles = [cls(BN=bn, WG=wg, MI=mi, STAGES=stages) for bn, wg, mi, stages in shapes]
        return [k for k in tiles if k.fits()] + [SPLIT_PROBE]


SPLIT_PROBE = WgmmaKnobs(BN=64, WG=1, SPLIT=2)
FIT_TILES = [split_k.Tile(k.as_dict(), k.BM, k.BN, BK, 2048)
             for k in (WgmmaKnobs(), WgmmaKnobs(BN=64), WgmmaKnobs(WG=1), WgmmaKnobs(BN=64, WG=1))]
"""`suggest`'s tiles (128 or 64 rows by 128 or 64 columns), at wgmma's 2048 float16 MACs per SM clock."""


def suggest(task, sm_count: int) -> list[dict]:
    """Tiles and split-K ranked by `split_k`'s cost model for this shape (symbolic sizes by
    their bucket)."""
    c = match_contraction(task)
    return split_k.rank(FIT_TILES, *(split_k.bucket(x) for x in (c.M, c.N, c.K, c.batch_count)), sm_count, 2)


def applies(task) -> bool:
    c = match_contraction(task)
    return (c is not None and c.a.dtype in dtypes.HALF_FLOATS and c.a.dtype == c.b.dtype
            and c.K > 0)


def render(task, **knobs) -> CudaProgram:
    """The program of `task` at the setting `knobs` (`WgmmaKnobs`' fields): the staging kernels
    of operands that need them, the GEMM, and split-K's sum where K is split."""
    c: Contraction = match_contraction(task)
    k = WgmmaKnobs(**knobs)
    if not k.fits():
        raise ValueError(f"matmul_wgmma: {k} needs {k.smem_bytes()} bytes of shared memory (at most {MAX_SMEM})")
    args, temporaries = tuple(c.args.split(", ")), []
    a = stage.stage(c, c.a, c.M, "kiln_stage_a", temporaries)
    b = stage.stage(c, c.b, c.N, "kiln_stage_b", temporaries)
    K = stage.padded_k(c) if a.launch or b.launch else c.K
    sk = split_k.plan(k.SPLIT, c.M, c.N, K, BK, c.batch_count, c.params, args, temporaries, text=c.text)
    enums = {"NT": 128 * k.WG, "BM": k.BM, "BN": k.BN, "BK": BK, "MI": k.MI, "STAGES": k.STAGES, "AHEAD": k.STAGES - 2}
    program = PROGRAM.format(enums=", ".join(f"{name} = {v}" for name, v in enums.items()), a_row=a.x_stride,
                             b_row=b.x_stride, a_batch=a.batch, b_batch=b.batch)
    defines = {"M": c.text(c.M), "N": c.text(c.N), "K": c.text(K), "ARGS": c.args, **sk.defines}
    kernels = [ptx.wgmma_m64k16(k.BN, c.a.dtype), a.source, b.source, sk.stores, program,
               device_code(__package__, "cuda/matmul_wgmma.cuh"), sk.source]
    source = template_source(kernels, defines, c.epilogue, (ptx.CP_ASYNC, ptx.LDMATRIX, ptx.WGMMA))
    tiles = as_dim(-(-c.M // k.BM) * -(-c.N // k.BN))
    launches = [s.launch for s in (a, b) if s.launch]
    launches.append(Launch("kiln_matmul_wgmma", args + sk.args + (a.arg, b.arg), (128 * k.WG, 1, 1),
                           grid=(tiles, k.SPLIT, as_dim(c.batch_count)), smem=k.smem_bytes()))
    launches += sk.launches
    return CudaProgram(source, launches, temporaries, arch_suffix="a", min_arch=90, alignment=16,
                       sizes=c.sizes.values)


TEMPLATE = Template("matmul_wgmma", ("matmul", "linear", "dft"), "cuda", render, priority=20, applies=applies,
                    space=WgmmaKnobs.settings, min_arch=90, suggest=suggest, reads_views=True, symbolic=True)
