"""Attention for decoding (sm_80+): a few queries (at most 16) against many keys (at least
256), float16 and bfloat16, head dims 64, 80, 96 and 128.

Ranked before `attention_flash` where both apply: on an H100 (benchmarks/HISTORY.md, session of
2026-11-25) it runs the issue's decode shape (8 x 32 query / 8 KV heads, 1 query, 4096 keys,
128) at 0.95x of torch's SDPA against flash's 0.46x, and 16 queries at 1.48x against 0.92x.

Decoding is a stream over the KV cache, each key and value used by only `group * Lq` query
rows (the queries of the query heads that share its key/value head). `attention_flash`, one
CTA per query head, reads every key and value once per query head (`group` times for
grouped-query attention) into MMA tiles of 16 rows that mostly hold padding. Here a CTA owns
one key/value head, one row block and one share of the keys (split-KV): the group * Lq query
rows of that head are packed into the tile rows (tile row r is query r % Lq of query
head r // Lq), so every key and value is read from global memory once per share (per row block:
more than 128 rows take several).

The CTA's NW warps form WR row warps (MT * 16 rows each, ROW_BLOCK = WR * MT * 16 rows) times
WK = NW / WR key warps. It walks its share of the keys KT = WK * BN at a time through two
shared-memory stages of K and V (`cp.async` 16-byte copies, the next tile in flight while the
current one is used); key warp w takes keys w * BN .. of each tile for its rows with
`attention_flash`'s tile step (`cuda/attention_flash.cuh`'s `attend`: S = Q K^T with
`mma.sync`, float32, mask, causal and key-length edges, online softmax in the log2 domain,
O += P V; it reads `kiln_attention_decode_program`, `attention_flash.program`'s struct, whose
`query_*` members map tile rows to queries). At the end the key warps merge their rows' maxima,
sums and values through shared memory (`merge_shares`, the merge `attention_flash`'s split-KV
combine uses) and store the rows through the epilogue hooks, or, with SPLIT > 1, write the
share's partial results to `attention_flash`'s temporaries for its `kiln_attention_combine`.

The task is read as `attention_flash` reads it (`attention_match.match_attention`): q, k and v
through their strides, the mask through the core-rendered `kiln_mask`, the output through the
epilogue hooks. A fully masked row keeps sum 0 and gets zeros, as the operator defines.
Symbolic sizes are kernel arguments as in `attention_flash`: a KV cache growing by a key a step
keeps one source within a power-of-two bucket of its length (`suggest`).

The device code is `cuda/attention_decode.cuh` (the kernel), on `cuda/attention_flash.cuh`'s
tile step and merge (`attention_flash.CODE`) and, split, `cuda/attention_combine.cuh`; this
module renders `kiln_attention_decode_program` with `attention_flash.program`: the knobs, their
derived sizes (WK, KT, ROW_BLOCK), GROUP, and the tile rows' queries. Knobs: `DecodeKnobs`,
whose fields' defaults are the level-0 setting.
"""
from __future__ import annotations

from dataclasses import dataclass

from kiln.template import CudaProgram, Knobs, Launch, Template, as_dim, device_code, dtypes, ptx, template_source
from kiln_ops_builtin.templates.attention_flash import (CODE, HEAD_DIMS, MAX_SMEM, PAD, UNSPLIT, program,
                                                        split_kv, strides)
from kiln_ops_builtin.templates.attention_match import Attention, match_attention
from kiln_ops_builtin.templates.split_k import bucket

MAX_QUERIES = 16
MIN_KEYS = 256
CTAS_PER_SM = 2
"""Split-KV grids of about two CTAs a multiprocessor stream the KV cache fastest (H100 sweep,
benchmarks/HISTORY.md, session of 2026-11-26: 8 x 32/8 heads x 4096 keys x 128 at 4 shares
51.9-53.8 us against 54.8-57.8 at the 6 that filled every CTA slot; 4 x 16/4 heads x 16384 keys x
64 at 8 shares 28.5 us against 36.0 at 37), at about 2.5 TB/s of DRAM reads."""


@dataclass(frozen=True)
class DecodeKnobs(Knobs):
    """NW warps a CTA: WR row warps of MT (1 or 2) 16-row MMA tiles each (ROW_BLOCK rows) times
    WK = NW / WR key warps of BN keys each (KT keys a tile); the keys split SPLIT ways (split-KV).
    The defaults are level 0: four key warps of 16 keys each over 16 rows, the keys split four
    ways."""

    BN: int = 16
    NW: int = 4
    MT: int = 1
    WR: int = 1
    SPLIT: int = 4

    @property
    def WK(self) -> int:
        """Key warps."""
        return self.NW // self.WR

    @property
    def ROW_BLOCK(self) -> int:
        """Tile rows a CTA."""
        return self.WR * self.MT * 16

    @property
    def KT(self) -> int:
        """Keys a shared-memory tile: BN for each key warp."""
        return self.WK * self.BN

    def smem_bytes(self, d: int) -> int:
        """The dynamic shared memory of a CTA at head dim `d`: the query rows, then two stages of
        K and V tiles, which the key warps' merge reuses."""
        keys = 4 * self.KT * (d + PAD) * 2
        return self.ROW_BLOCK * (d + PAD) * 2 + max(keys, self.WK * self.ROW_BLOCK * (d + 2) * 4)

    def valid(self) -> bool:
        """Whether the NW warps split into WR row warps of MT (1 or 2) MMA tiles and key warps
        of BN keys (a multiple of 16), within the shared memory at the largest head dim."""
        return self.WR > 0 and self.NW % self.WR == 0 and self.MT in (1, 2) and self.BN % 16 == 0 \
            and self.BN > 0 and self.smem_bytes(max(HEAD_DIMS)) <= MAX_SMEM and self.SPLIT >= 1

    @classmethod
    def space(cls, level: int) -> list[DecodeKnobs]:
        """Level 0: the default; 1: that tile unsplit and split 2 to 16 ways, 32-key warps,
        eight warps, 32 to 128 rows; 2: more of each."""
        if level == 0:
            return [cls()]
        out = [cls(SPLIT=split) for split in (1, 2, 4, 8, 16)]
        out += [cls(BN=32), cls(NW=8), cls(MT=2), cls(BN=32, MT=2, WR=2), cls(BN=64, MT=2, WR=4, SPLIT=2)]
        if level == 2:
            out += [cls(NW=2, SPLIT=8), cls(BN=32, SPLIT=8), cls(NW=8, MT=2, WR=2), cls(BN=32, NW=8, WR=2, SPLIT=8),
                    cls(BN=64, WR=4), cls(SPLIT=32)]
        return out


def applies(task) -> bool:
    """Attention tasks of at most MAX_QUERIES queries against at least MIN_KEYS keys that
    `attention_flash` would take (16-bit, its head dims, D == Dv)."""
    a = match_attention(task)
    return (a is not None and a.dtype in dtypes.HALF_FLOATS
            and a.q.dtype == a.k.dtype == a.v.dtype and a.D == a.Dv and a.D in HEAD_DIMS
            and a.Lq <= MAX_QUERIES and a.Lk >= MIN_KEYS)


def _keys(a: Attention) -> int:
    """The keys any query sees: causal attention's end at the last query."""
    return min(a.Lk, a.Lq) if a.causal else a.Lk


def suggest(task, sm_count: int) -> list[dict]:
    """Rows packed into one row block where they fit (up to 128 rows on four row warps), keys
    64 a tile over the remaining warps; the keys split so that the grid has up to
    CTAS_PER_SM CTAs a multiprocessor, each share at least two tiles and none empty
    (`kiln_attention_combine` merges the shares); then level 1. Symbolic sizes count as their
    bucket (`split_k.bucket`), so that the lengths of a bucket share one source."""
    a = match_attention(task)
    Lq, batch = bucket(a.Lq), bucket(a.batch_count)
    rows = a.group * Lq
    mt, wr = (1, 1) if rows <= 16 else (2, 1) if rows <= 32 else (2, 2) if rows <= 64 else (2, 4)
    nw = 4
    ctas = batch // a.group * -(-rows // (wr * mt * 16))
    tiles = -(-bucket(_keys(a)) // 64)
    split = max(1, min(CTAS_PER_SM * sm_count // ctas, tiles // 2))
    split = -(-tiles // -(-tiles // split))
    first = DecodeKnobs(BN=64 // (nw // wr), NW=nw, MT=mt, WR=wr, SPLIT=split).as_dict()
    return [first] + [k for k in DecodeKnobs.settings(1) if k != first]


def render(task, **knobs) -> CudaProgram:
    """The program of `task` (see the module doc) at the setting `knobs` (`DecodeKnobs`'
    fields), and `kiln_attention_combine` after its kernel where SPLIT > 1."""
    a: Attention = match_attention(task)
    k = DecodeKnobs(**knobs)
    rows = a.group * a.Lq
    row_blocks = (rows + k.ROW_BLOCK - 1) // k.ROW_BLOCK
    args, temporaries, params, launches, kernels = tuple(a.args.split(", ")), [], a.params, [], []
    defines = {
        **a.device_defines(), **strides(a), "BATCH": a.text(a.batch_count), "Q_PARAM": a.q.param,
        "Q_BASE": a.base(a.q, "qbh"), "ROW_BLOCKS": a.int_text(row_blocks),
        "TILES_PER_SPLIT": a.int_text(((_keys(a) + k.KT - 1) // k.KT + k.SPLIT - 1) // k.SPLIT), **UNSPLIT,
    }
    if k.SPLIT > 1:
        sk = split_kv(a, k.SPLIT, params, args)
        params, args, temporaries, kernels = sk.params, sk.args, sk.temporaries, sk.kernels
        defines.update(sk.defines)
        launches.append(sk.combine)
    defines["KERNEL_PARAMS"] = params
    enums = {"BN": k.BN, "NT": k.NW * 32, "MT": k.MT, "SPLIT": k.SPLIT, "WR": k.WR, "WK": k.WK, "KT": k.KT,
             "ROW_BLOCK": k.ROW_BLOCK, "GROUP": a.group}
    source = template_source([CODE, program("kiln_attention_decode_program", a, enums, i="r % LQ",
                                            bh="bh * GROUP + r / LQ", ok="r < GROUP * LQ"),
                              device_code(__package__, "cuda/attention_decode.cuh"), *kernels], defines, a.hooks,
                             (ptx.CP_ASYNC, ptx.LDMATRIX, ptx.MMA, ptx.CVT_EX2))
    blocks = as_dim(k.SPLIT * row_blocks * (a.batch_count // a.group))
    launches.insert(0, Launch("kiln_attention_decode", args, (k.NW * 32, 1, 1), grid=(blocks, 1, 1),
                              smem=k.smem_bytes(a.D)))
    return CudaProgram(source, launches, temporaries, alignment=16, sizes=a.sizes.values,
                       streaming=tuple(launch.kernel for launch in launches))


TEMPLATE = Template("attention_decode", ("attention",), "cuda", render, priority=20, applies=applies,
                    space=DecodeKnobs.settings, suggest=suggest, reads_views=True, symbolic=True)
