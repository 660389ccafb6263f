"""Fused attention on tensor cores (sm_80+): FlashAttention-2's forward, float16 and bfloat16,
head dims 64, 80, 96 and 128.

A CTA owns BM queries of one (batch, head): NW warps of MT * 16 rows each. It copies its
queries once, then walks the keys BN at a time through two shared-memory stages of K and V
tiles (`cp.async` 16-byte copies; rows padded by 16 bytes, so that the eight rows an `ldmatrix`
reads fall in distinct bank groups), the next tile's copies in flight while the current one is
multiplied. Per tile, each warp computes S = Q K^T with `mma.sync.m16n8k16` (float32
accumulators, in registers), scales it into the log2 domain, applies the mask and the causal or
key-length edge, and runs the online softmax on it in registers (row maximum and sum per
thread over a quad's shuffles; `ex2.approx`); P, packed to 16 bits in registers, is multiplied
by V (`ldmatrix.trans`) into the output accumulators, rescaled as the maximum moves. Causal
attention skips the tiles above the diagonal and masks only the tiles that cross it; a fully
masked row keeps sum 0 and gets zeros, as the operator defines.

Decoding (a few queries against many keys) splits the keys SPLIT ways (split-KV): each CTA
writes its share's unnormalized output, row maximum and sum to float32 temporaries, and
`kiln_attention_combine` rescales the shares to the common maximum, normalizes, and stores
through the epilogue hooks. Warps whose rows are all past the queries skip the math.
`attention_decode` (at most 16 queries, at least 256 keys; ranked after this template until it
has been verified on a GPU) reads the keys once for all the query heads of a key/value head,
with this tile step (`attend`, its rows mapped to queries by its program's `query_*` members)
and this merge.

The task is read by `attention_match.match_attention`: q, k and v straight from their inputs
(any strides of whole 16-byte chunks, so a [B, L, H, D] view needs no copy; key/value head
h // group for grouped-query attention), the mask through the core-rendered hook `kiln_mask`,
and the output through the epilogue hooks, where fused epilogues go.
Symbolic sizes (sequence lengths, a KV cache, a batch) are kernel arguments (`Attention.sizes`);
`suggest` buckets them by powers of two, so the lengths of a bucket share one source.

The device code is `cuda/attention_flash.cuh` (the tile step and the merge of shares, on
`cuda/attention_softmax.cuh` and `cuda/mma_sync.cuh`'s element types; `attention_decode` runs
it too), `cuda/attention_flash_kernel.cuh` (the kernel) and `cuda/attention_combine.cuh` (the
split-KV merge); between them this module renders `kiln_attention_flash_program` (`program`):
the knobs, the head dim, the element type and the softmax's members
(`attention_softmax.members`). Knobs: `FlashKnobs`, whose fields' defaults are the level-0
setting.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from kiln.template import CudaProgram, KernelArgs, Knobs, Launch, Template, as_dim, device_code, dtypes, ptx, template_source
from kiln_ops_builtin.templates import attention_softmax
from kiln_ops_builtin.templates.attention_match import Attention, match_attention
from kiln_ops_builtin.templates.matmul_tc import ELEMENTS
from kiln_ops_builtin.templates.split_k import bucket

MAX_SMEM = 227 * 1024
HEAD_DIMS = (64, 80, 96, 128)
PAD = 8                                   # elements of padding per shared-memory row (16 bytes)

CODE = attention_softmax.CODE + device_code(__package__, "cuda/mma_sync.cuh", "cuda/attention_flash.cuh")
"""The tile step's device code (`cuda/attention_flash.cuh` and what it needs but the PTX wrappers
CP_ASYNC, LDMATRIX, MMA and CVT_EX2), ahead of a kernel's program struct (`program`)."""

# What cuda/attention_flash.cuh's tile step (and a kernel on it) reads of a program
PROGRAM = """
struct {name} {{
    enum : int {{ {enums} }};
    using Elem = kiln::mma_sync::{elem};
{members}}};
"""

# What cuda/attention_combine.cuh's kernel reads of a program
COMBINE = """
struct kiln_attention_combine_program {{
    enum : int {{ SPLIT = {split}, D = {d} }};
}};
"""

UNSPLIT = {"PART": "((float*)nullptr)", "STATS": "((float*)nullptr)"}
"""The partial results' temporaries of a program whose keys are not split: none (the kernels'
`if constexpr` branches that would write them are discarded)."""


def smem_bytes(bm: int, bn: int, d: int) -> int:
    """The dynamic shared memory of a CTA: BM query rows, two stages of BN rows of K and of V."""
    return (bm + 4 * bn) * (d + PAD) * 2


def valid_tile(bm: int, bn: int, nw: int) -> bool:
    """Whether BM splits into NW warps of one or two 16-row MMA tiles each, BN is a multiple of
    16, and the tiles fit the largest head dim."""
    return bm % (16 * nw) == 0 and bm // (16 * nw) in (1, 2) and bn % 16 == 0 and bn > 0 \
        and smem_bytes(bm, bn, max(HEAD_DIMS)) <= MAX_SMEM


@dataclass(frozen=True)
class FlashKnobs(Knobs):
    """BM queries a CTA on NW warps (MT = BM / (16 * NW) MMA tiles of 16 rows each, 1 or 2), key
    tiles of BN, the keys split SPLIT ways (split-KV). The defaults are level 0: 128 queries on
    four warps (32 rows each), 64-key tiles, the best or within 2% of it on the long sequences
    of benchmarks/attention_bench.py's sweep on an H200 (head dims 64 to 128, causal or not)."""

    BM: int = 128
    BN: int = 64
    NW: int = 4
    SPLIT: int = 1

    @property
    def MT(self) -> int:
        """16-row MMA tiles a warp."""
        return self.BM // (16 * self.NW)

    def valid(self) -> bool:
        return valid_tile(self.BM, self.BN, self.NW) and self.SPLIT >= 1

    @classmethod
    def space(cls, level: int) -> list[FlashKnobs]:
        """Level 0: the default; 1: query and key tile sizes and warp counts around it, and
        split-KV; 2: every valid tile, and more splits."""
        if level == 0:
            return [cls()]
        if level == 1:
            return [cls(), cls(NW=8), cls(BN=32), cls(BM=64), cls(BN=128, NW=8), cls(BM=64, BN=32),
                    cls(BM=64, SPLIT=3)]
        return [cls(BM=bm, BN=bn, NW=nw) for bm in (64, 128) for bn in (32, 64, 128) for nw in (2, 4, 8)
                if valid_tile(bm, bn, nw)] + [cls(BM=64, SPLIT=split) for split in (2, 4, 8, 16)]


def strides(a: Attention) -> dict:
    """The operands' row strides as `cuda/attention_flash.cuh` reads them: macros Q_RS, K_RS,
    V_RS (int64s; literals where they are numbers)."""
    return {f"{name}_RS": f"(int64_t){a.text(x.row_stride)}" for name, x in (("Q", a.q), ("K", a.k), ("V", a.v))}


def program(name: str, a: Attention, enums: dict, **rows) -> str:
    """The struct `name` through which `cuda/attention_flash.cuh`'s tile step and a kernel on it
    read a program of `a`: the enumerators `enums` (the knobs: BN, NT, MT ...), the head dim D
    and LDS (a shared-memory row: D and PAD), the element type Elem, and
    `attention_softmax.members(a, **rows)`."""
    enums = {**enums, "D": a.D, "LDS": a.D + PAD}
    return PROGRAM.format(name=name, enums=", ".join(f"{k} = {v}" for k, v in enums.items()), elem=ELEMENTS[a.dtype],
                          members=attention_softmax.members(a, **rows))


class SplitKV(NamedTuple):
    """What splitting the keys `SPLIT` ways adds to an attention program."""

    params: str               # the kernel parameters, the temporaries' appended
    args: tuple               # the kernel arguments, likewise
    temporaries: list         # float32 [SPLIT][BATCH][LQ][D] values and [SPLIT][BATCH][LQ][2] maxima and sums
    defines: dict             # PART and STATS, the temporaries' names
    kernels: list             # kiln_attention_combine's program and device code (after `CODE`)
    combine: Launch           # `kiln_attention_combine`, after the attention kernel


def split_kv(a: Attention, split: int, params: str, args: tuple) -> SplitKV:
    """The partial results of `split` key shares of `a` and the kernel that merges them: each
    share writes its rows' unnormalized values relative to their maximum (log2 domain), the
    maximum and the sum, and `kiln_attention_combine` stores the merged rows through the
    epilogue hooks."""
    part, stats = KernelArgs.temporary(0), KernelArgs.temporary(1)
    rows = (split, as_dim(a.batch_count), as_dim(a.Lq))
    temporaries = [(rows + (a.D,), dtypes.float32), (rows + (2,), dtypes.float32)]
    args = args + (part, stats)
    combine = Launch("kiln_attention_combine", args, (256, 1, 1), items=as_dim(a.batch_count * a.Lq * a.D // 2),
                     per_block=256, waves=8)
    kernels = [COMBINE.format(split=split, d=a.D), device_code(__package__, "cuda/attention_combine.cuh")]
    return SplitKV(params + f", float* __restrict__ {part}, float* __restrict__ {stats}", args, temporaries,
                   {"PART": part, "STATS": stats}, kernels, combine)


def applies(task) -> bool:
    a = match_attention(task)
    return (a is not None and a.dtype in dtypes.HALF_FLOATS
            and a.q.dtype == a.k.dtype == a.v.dtype and a.D == a.Dv and a.D in HEAD_DIMS)


def suggest(task, sm_count: int) -> list[dict]:
    """Level 0 by shape. Decoding (at most 16 queries, at least 16 key tiles) splits the keys
    over enough CTAs for eight a multiprocessor, each at least four tiles (`kiln_attention_combine`
    merges the shares); 64-query blocks on four warps for at most 64 queries or where 128-query
    blocks would not fill the GPU (short sequences); else the default. Symbolic sizes count as
    their bucket (`split_k.bucket`), so that the sizes of a bucket share one source."""
    a = match_attention(task)
    Lq, Lk, batch = (bucket(x) for x in (a.Lq, a.Lk, a.batch_count))
    tiles = -(-Lk // 64)
    if Lq <= 16 and tiles >= 16:
        split = min(-(-8 * sm_count // batch), tiles // 4)
        return [FlashKnobs(BM=64, SPLIT=split).as_dict()]
    if Lq <= 64 or -(-Lq // 128) * batch < sm_count:
        return [FlashKnobs(BM=64).as_dict()]
    return FlashKnobs.settings(0)


def render(task, **knobs) -> CudaProgram:
    """The program of `task` (see the module doc) at the setting `knobs` (`FlashKnobs`' fields),
    and `kiln_attention_combine` after its kernel where SPLIT > 1."""
    a: Attention = match_attention(task)
    k = FlashKnobs(**knobs)
    nt, m_blocks = k.NW * 32, (a.Lq + k.BM - 1) // k.BM
    args, temporaries, params, launches, kernels = tuple(a.args.split(", ")), [], a.params, [], []
    defines = {**a.device_defines(), **strides(a), "BATCH": a.text(a.batch_count), "M_BLOCKS": a.int_text(m_blocks),
               "TILES_PER_SPLIT": a.int_text(((a.Lk + k.BN - 1) // k.BN + k.SPLIT - 1) // k.SPLIT), **UNSPLIT}
    if k.SPLIT > 1:
        sk = split_kv(a, k.SPLIT, params, args)
        params, args, temporaries, kernels = sk.params, sk.args, sk.temporaries, sk.kernels
        defines.update(sk.defines)
        launches.append(sk.combine)
    defines["KERNEL_PARAMS"] = params
    enums = {"BM": k.BM, "BN": k.BN, "NT": nt, "MT": k.MT, "SPLIT": k.SPLIT}
    source = template_source([CODE, program("kiln_attention_flash_program", a, enums),
                              device_code(__package__, "cuda/attention_flash_kernel.cuh"), *kernels], defines, a.hooks,
                             (ptx.CP_ASYNC, ptx.LDMATRIX, ptx.MMA, ptx.CVT_EX2))
    blocks = as_dim(k.SPLIT * m_blocks * a.batch_count)
    launches.insert(0, Launch("kiln_attention_flash", args, (nt, 1, 1), grid=(blocks, 1, 1),
                              smem=smem_bytes(k.BM, k.BN, a.D)))
    return CudaProgram(source, launches, temporaries, alignment=16, sizes=a.sizes.values)


TEMPLATE = Template("attention_flash", ("attention",), "cuda", render, priority=10, applies=applies,
                    space=FlashKnobs.settings, suggest=suggest, reads_views=True, symbolic=True)
