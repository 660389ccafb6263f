"""Fused attention on Hopper (sm_90a): FlashAttention-3's forward, float16 and bfloat16, head
dims 64 and 128 (80 and 96 computed as 128: TMA fills the columns past D with zeros), at least
MIN_QUERIES queries (decoding is `attention_decode`'s) and more keys than one tile of 128 (with
one key tile its pipeline has nothing to overlap: `attention_flash` is faster there, 6.1 against
6.8 us on BERT's 128 tokens on an H200).

A CTA owns BM = 64 * CW queries of one (batch, head) and is warp-specialized. Its producer
warpgroup (registers lowered by `setmaxnreg.dec`) has one thread issue TMA copies
(`cp.async.bulk.tensor`, 128-byte swizzle): the CTA's queries once, then K and V tiles of BN
keys into STAGES-deep rings. Each slot of K and each of V has a *full* mbarrier (the copies'
transaction bytes) and an *empty* one (every consumer thread's release), so that a K slot
frees once its S = Q K^T is done and a V slot once its O += P V is. Tiles are DP / 64 boxes of
64 columns (128 bytes) by their rows, in the layout TMA's swizzle gives (DP: the head dim in
whole boxes). Rows past the queries or keys come as zeros.

CW consumer warpgroups (`setmaxnreg.inc`) own 64 query rows each. Per key tile, S = Q K^T is
`wgmma.mma_async.m64n{BN}k16` with both operands K-major in shared memory (float32
accumulators); the online softmax runs on that fragment in registers (`attention_softmax`: log2
domain, `ex2.approx`, row maxima and sums over a quad, the mask hook, causal and key-length
edges only on the tiles that cross them); P, packed to 16 bits in registers, is wgmma's
register A operand of O += P V, V read from shared memory as an MN-major B operand (the
transpose bit). The tiles overlap inside a warpgroup: tile t's S = Q K^T and tile t - 1's
O += P V are issued together, and tile t's softmax runs while the second is in flight; O is
rescaled once that is done. Causal attention skips the key tiles after a consumer's last row
(it waits for and releases them, since its partner may need them) and masks only the tiles
that cross its diagonal; heavy query blocks start first. A fully masked row keeps sum 0 and
gets zeros, as the operator defines. The output goes through the epilogue hooks, as in
`attention_flash`.

The task is read by `attention_match.match_attention`; q, k and v become tensor maps over
their inputs (columns, rows, then up to three batch dims: [B, L, H, D] views, offsets into a
packed projection and grouped-query heads need no copy; the match already asks for a unit
column stride and the others whole 16 bytes, as TMA does). Operands of more batch dims or rows
at stride 0 are declined, as are decoding shapes, other dtypes and head dims.
Symbolic sizes are kernel arguments as in `attention_flash` (the tensor maps are encoded at
launch from each run's sizes); `suggest` buckets them, so the lengths of a bucket share one
source.

The device code is `cuda/attention_sm90.cuh` (the kernel), on `cuda/attention_softmax.cuh`'s
online softmax and `cuda/tma_batch.cuh`'s copies at a flat batch's coordinates, with the core's
wgmma products for the shapes (`WGMMA_QK`, `WGMMA_PV`); this module renders
`kiln_attention_sm90_program` between them: the knobs and head dims as enumerators, `pack` (two
floats to one register of the element type), each operand's batch dims `q_batch`, `k_batch`,
`v_batch` (`kiln::tma::Batch`) and the softmax's members (`attention_softmax.members`). Knobs:
`AttentionSm90Knobs`, whose fields' defaults are the level-0 setting.

Ranked above `attention_flash` (below `attention_decode`): on an H200 it is 1.25-1.8x torch's
flash backend on 2k-4k tokens, where `attention_flash` is 0.85-0.98x.
"""
from __future__ import annotations

from dataclasses import dataclass

from kiln.template import CudaProgram, Knobs, Launch, Template, TensorMapArg, as_dim, device_code, dtypes, ptx, template_source
from kiln_ops_builtin.templates import attention_softmax
from kiln_ops_builtin.templates.attention_match import Attention, Strided, match_attention
from kiln_ops_builtin.templates.sm90_engine import MAX_SMEM, SWIZZLE_ATOM, consumer_registers
from kiln_ops_builtin.templates.split_k import bucket

HEAD_DIMS = (64, 80, 96, 128)
MIN_QUERIES = 64
MIN_KEYS = 129
BOX = 64                  # 16-bit columns of a TMA box: 128 bytes, the swizzle's width
PRODUCER_REGS = 24       # the producer's registers (one thread issuing copies) ...
CONSUMER_REGS = 240      # ... and at most the consumers' (their S, P and O fragments)

# What cuda/attention_sm90.cuh's kernel, and cuda/attention_softmax.cuh's online softmax, read of a program
PROGRAM = """
struct kiln_attention_sm90_program {{
    enum : int {{ {enums} }};
    static __device__ __forceinline__ unsigned pack(float lo, float hi) {{ return {pack}(lo, hi); }}
{batches}{members}}};
"""

# A member q_batch, k_batch or v_batch of the program: the operand's batch dims (kiln::tma::Batch)
BATCH = """\
    static __device__ __forceinline__ kiln::tma::Batch<{rank}> {name}_batch(PARAMS) {{ return {{{dims}}}; }}
"""


def padded(d: int) -> int:
    """The head dim as the tiles hold it: whole 64-column boxes."""
    return -(-d // BOX) * BOX


@dataclass(frozen=True)
class AttentionSm90Knobs(Knobs):
    """BM = 64 * CW queries a CTA on CW consumer warpgroups (1 or 2), key tiles of BN (a multiple
    of 16 up to 256, wgmma's N), rings of STAGES slots of K and of V (at least 2). Valid where
    the setting fits at the smallest head dim (`fits`); `render` asks it to fit at the task's.
    The defaults are level 0: 128 queries on two consumers, 128-key tiles, two stages."""

    BN: int = 128
    CW: int = 2
    STAGES: int = 2

    @property
    def BM(self) -> int:
        """Queries a CTA."""
        return 64 * self.CW

    def smem_bytes(self, dp: int) -> int:
        """The queries, STAGES slots of K and V, the mbarriers and 1024 bytes of alignment, at
        padded head dim dp."""
        return (self.BM + 2 * self.STAGES * self.BN) * dp * 2 + 8 * (1 + 4 * self.STAGES) + 1024

    def fits(self, dp: int = 128) -> bool:
        """Whether the setting fits shared memory and the consumers' registers (O, S and P of a
        thread, and a working set) at padded head dim dp."""
        regs = dp // 2 + self.BN // 2 + self.BN // 4 + 30
        return self.smem_bytes(dp) <= MAX_SMEM and regs <= consumer_registers(self.CW, PRODUCER_REGS, CONSUMER_REGS)

    def valid(self) -> bool:
        return (self.BN % 16 == 0 and 16 <= self.BN <= 256 and self.CW in (1, 2) and self.STAGES >= 2
                and self.fits(BOX))

    @classmethod
    def space(cls, level: int) -> list[AttentionSm90Knobs]:
        """Level 0: the default; 1: 64- and 176-key tiles, one consumer, three stages; 2: every
        setting of 64, 128 or 176 keys, one or two consumers, two or three stages that fits head
        dim 128."""
        if level == 0:
            return [cls()]
        if level == 1:
            return [cls(), cls(BN=64), cls(BN=176), cls(CW=1), cls(STAGES=3)]
        return [k for k in cls.grid(BN=(64, 128, 176), CW=(1, 2), STAGES=(2, 3)) if k.fits()]


def _tensor_map(a: Attention, x: Strided, rows, box_rows: int) -> tuple[TensorMapArg, list]:
    """The tensor map of operand `x` (columns, `rows` rows, its batch dims) with boxes of 64
    columns by `box_rows` rows, and its `batch_axes`; raises ValueError where TMA cannot
    describe it."""
    axes = a.batch_axes(x)
    if len(axes) > 3:
        raise ValueError(f"{len(axes)} batch dims (TMA takes ranks up to 5)")
    if not x.row_stride:
        raise ValueError("rows at stride 0 (a single key, or keys broadcast along the sequence)")
    strides, extents = (tuple(as_dim(axis[k]) for axis in axes) for k in (3, 4))
    arg = TensorMapArg(x.param, x.dtype, (a.D, as_dim(rows)) + extents, (1, as_dim(x.row_stride)) + strides,
                       (BOX, box_rows) + (1,) * len(axes), offset=as_dim(x.offset))
    return arg, axes


def _maps(a: Attention, bm: int, bn: int):
    """(name, tensor map, batch axes) of q, k and v, or None where TMA cannot take one."""
    try:
        return [(name, *_tensor_map(a, x, rows, box)) for name, x, rows, box in
                (("Q", a.q, a.Lq, bm), ("K", a.k, a.Lk, bn), ("V", a.v, a.Lk, bn))]
    except ValueError:
        return None


def _batch(name: str, axes: list) -> str:
    """The program's member `{name}_batch`: the operand's batch dims, {inner, size, divisor} each."""
    dims = ", ".join(f"{{{inner}, {size}, {divisor}}}" for inner, size, divisor, _, _ in axes)
    return BATCH.format(name=name.lower(), rank=len(axes), dims=f"{{{dims}}}" if axes else "")


def applies(task) -> bool:
    """16-bit attention with D == Dv among HEAD_DIMS, at least MIN_QUERIES queries and MIN_KEYS
    keys (a symbolic length by its bucket), and operands TMA can read (unit column stride, the
    others whole 16 bytes, at most three batch dims)."""
    a = match_attention(task)
    return (a is not None and a.dtype in dtypes.HALF_FLOATS and a.q.dtype == a.k.dtype == a.v.dtype
            and a.D == a.Dv and a.D in HEAD_DIMS and a.Lq >= MIN_QUERIES and bucket(a.Lk) >= MIN_KEYS
            and _maps(a, 128, 128) is not None)


def suggest(task, sm_count: int) -> list[dict]:
    """128 queries on two consumers, or 64 on one where 128-query blocks would fill less than
    three quarters of the GPU's multiprocessors;
    176-key tiles for long keys at head dim 128 without causal edge or mask (FlashAttention-3's
    choice; with either, the index arithmetic of the edges spills at 176), else 128; two
    stages; then level 1. Symbolic sizes count as their bucket (`split_k.bucket`),
    so that the lengths of a bucket share one source."""
    a = match_attention(task)
    Lq, Lk, batch = (bucket(x) for x in (a.Lq, a.Lk, a.batch_count))
    cw = 2 if 4 * -(-Lq // 128) * batch >= 3 * sm_count else 1
    bn = 176 if padded(a.D) == 128 and not a.causal and a.mask is None and Lk >= 1024 else 128
    first = AttentionSm90Knobs(BN=bn, CW=cw)
    return [k.as_dict() for k in [first] + [k for k in AttentionSm90Knobs.space(1) if k != first]]


def render(task, **knobs) -> CudaProgram:
    """The kernel for `task` (see the module doc) at the setting `knobs` (`AttentionSm90Knobs`'
    fields), which must fit the task's head dim."""
    a: Attention = match_attention(task)
    k, dp = AttentionSm90Knobs(**knobs), padded(a.D)
    if not k.fits(dp):
        raise ValueError(f"attention_sm90: {k} does not fit head dim {a.D} (at most {MAX_SMEM} bytes of shared "
                         "memory and the consumers' registers)")
    maps = _maps(a, k.BM, k.BN)
    if maps is None:
        raise ValueError(f"attention_sm90: TMA cannot read the operands of {task!r}; `applies` declines it")
    m_blocks = (a.Lq + k.BM - 1) // k.BM
    enums = {"D": a.D, "DP": dp, "BM": k.BM, "BN": k.BN, "CW": k.CW, "STAGES": k.STAGES, "SWIZZLE_ATOM": SWIZZLE_ATOM,
             "PRODUCER_REGS": PRODUCER_REGS, "CONSUMER_REGS": consumer_registers(k.CW, PRODUCER_REGS, CONSUMER_REGS)}
    program = PROGRAM.format(enums=", ".join(f"{name} = {v}" for name, v in enums.items()), pack=ptx.pack_16x2(a.dtype),
                             batches="".join(_batch(name, axes) for name, _, axes in maps),
                             members=attention_softmax.members(a))
    kernels = [ptx.wgmma_m64k16(k.BN, a.dtype, 0, 0, "WGMMA_QK", scale_d=True),
               ptx.wgmma_m64k16_rs(dp, a.dtype, 1, "WGMMA_PV"), attention_softmax.CODE,
               device_code(__package__, "cuda/tma_batch.cuh"), program,
               device_code(__package__, "cuda/attention_sm90.cuh")]
    defines = {**a.device_defines(), "M_BLOCKS": a.int_text(m_blocks)}
    source = template_source(kernels, defines, a.hooks, (ptx.MBARRIER, ptx.TMA, ptx.WGMMA, ptx.CVT_EX2))
    launch = Launch("kiln_attention_sm90", tuple(a.args.split(", ")) + tuple(arg for _, arg, _ in maps),
                    (128 * (k.CW + 1), 1, 1), grid=(as_dim(m_blocks * a.batch_count), 1, 1), smem=k.smem_bytes(dp))
    return CudaProgram(source, [launch], arch_suffix="a", min_arch=90, alignment=16, sizes=a.sizes.values)


TEMPLATE = Template("attention_sm90", ("attention",), "cuda", render, priority=15, applies=applies,
                    space=AttentionSm90Knobs.settings, min_arch=90, suggest=suggest, reads_views=True, symbolic=True)
