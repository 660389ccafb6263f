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
rows of that head (QUERY_ROWS) are packed into the tile rows (tile row r is query r % Lq of query
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
"""
from __future__ import annotations

from kiln.template import CudaProgram, Launch, Template, dtypes, ptx, template_source
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

KERNEL = r"""
extern "C" __global__ void __launch_bounds__(kiln_attention_decode_program::NT)
    kiln_attention_decode(KERNEL_PARAMS) {
    using P = kiln_attention_decode_program;
    constexpr int NT = P::NT, BN = P::BN, D = P::D, LDS = P::LDS, MT = P::MT, SPLIT = P::SPLIT;
    constexpr bool CAUSAL = P::CAUSAL;
    extern __shared__ __align__(128) unsigned char kiln_smem[];
    uint16_t* Qs = (uint16_t*)kiln_smem;
    uint16_t* Ks = Qs + ROW_BLOCK * LDS;
    uint16_t* Vs = Ks + 2 * KT * LDS;
    float* shares = (float*)Ks;                                 // once the keys are done: per key warp,
    float* share_stats = shares + WK * ROW_BLOCK * D;           // [ROW_BLOCK][D] values, [ROW_BLOCK][2] max, sum
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wr = warp % WR, wk = warp / WR;
    const int sp = (int)(blockIdx.x % SPLIT);                  // the CTA's share of the keys
    const int64_t rest = blockIdx.x / SPLIT, bkv = rest / ROW_BLOCKS;
    const int r0 = (int)(rest % ROW_BLOCKS) * ROW_BLOCK;
    const int64_t kbh = bkv * GROUP;                            // the first query head of key/value head bkv
    const uint16_t* K = P::k(ARGS, kbh);
    const uint16_t* V = P::v(ARGS, kbh);
    const int keys = CAUSAL ? min(LK, LQ) : LK;
    const int tiles = (keys + KT - 1) / KT;
    const int t0 = min(tiles, sp * TILES_PER_SPLIT), t1 = min(tiles, t0 + TILES_PER_SPLIT);
    for (int idx = tid; idx < ROW_BLOCK * (D / 8); idx += NT) {
        const int row = idx / (D / 8), c = idx % (D / 8), r = r0 + row;
        const int64_t qbh = kbh + r / LQ;
        const bool ok = r < QUERY_ROWS;
        const uint16_t* src = (const uint16_t*)Q_PARAM + (ok ? (Q_BASE) + (r % LQ) * Q_RS + c * 8 : 0);
        kiln_cp_async16(Qs + row * LDS + c * 8, src, ok ? 16 : 0);
    }
    auto load_keys = [&](int stage, int n0) {
        kiln::attention::load_keys<P, KT>(Ks + stage * KT * LDS, Vs + stage * KT * LDS, K, V, n0, tid, ARGS);
    };
    if (t0 < t1) load_keys(0, t0 * KT);
    kiln_cp_async_commit();
    float o[MT][D / 2], mx[MT][2], sum[MT][2];
    kiln::attention::start_rows<P>(o, mx, sum);
    const int row0 = r0 + wr * MT * 16;
    const uint16_t* qs = Qs + wr * MT * 16 * LDS;
    for (int t = t0; t < t1; ++t) {
        if (t + 1 < t1) load_keys((t + 1 - t0) & 1, (t + 1) * KT);
        kiln_cp_async_commit();
        kiln_cp_async_wait<1>();
        __syncthreads();
        const int n0 = t * KT + wk * BN;
        const uint16_t* ks = Ks + (((t - t0) & 1) * KT + wk * BN) * LDS;
        const uint16_t* vs = Vs + (((t - t0) & 1) * KT + wk * BN) * LDS;
        if (row0 < QUERY_ROWS && n0 < keys) {
            if (CAUSAL || n0 + BN > LK)
                kiln::attention::attend<P, true>(o, mx, sum, qs, ks, vs, row0, n0, bkv, lane, ARGS);
            else
                kiln::attention::attend<P, false>(o, mx, sum, qs, ks, vs, row0, n0, bkv, lane, ARGS);
        }
        __syncthreads();
    }
    kiln_cp_async_wait<0>();        // an empty share's query copies
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float total = kiln::attention::quad_sum(sum[mt][h]);
            const int row = wk * ROW_BLOCK + wr * MT * 16 + mt * 16 + (lane >> 2) + h * 8;
#pragma unroll
            for (int dt = 0; dt < D / 8; ++dt)
                *(float2*)&shares[row * D + dt * 8 + (lane & 3) * 2] =
                    make_float2(o[mt][dt * 4 + 2 * h], o[mt][dt * 4 + 2 * h + 1]);
            if ((lane & 3) == 0) *(float2*)&share_stats[row * 2] = make_float2(mx[mt][h], total);
        }
    __syncthreads();
    for (int idx = tid; idx < ROW_BLOCK * (D / 2); idx += NT) {
        const int row = idx / (D / 2), n = idx % (D / 2) * 2, r = r0 + row;
        if (r >= QUERY_ROWS) break;
        float top, total;
        const float2 v = kiln::attention::merge_shares(WK, share_stats + row * 2, ROW_BLOCK * 2, shares + row * D + n,
                                                      ROW_BLOCK * D, top, total);
        const int64_t qbh = kbh + r / LQ, i = r % LQ;
        if constexpr (SPLIT > 1) {
            // the share's partial result: unnormalized, relative to the row maximum, with maximum and sum
            const int64_t out = ((int64_t)sp * BATCH + qbh) * LQ + i;
            *(float2*)&PART[out * D + n] = v;
            if (n == 0) *(float2*)&STATS[out * 2] = make_float2(top, total);
        } else {
            const float inv = total == 0.f ? 0.f : 1.f / total;
            kiln_epilogue2(ARGS, qbh, i, n, v.x * inv, v.y * inv);
        }
    }
}
"""


def _k(bn: int, nw: int, mt: int, wr: int, split: int = 1) -> dict:
    return {"BN": bn, "NW": nw, "MT": mt, "WR": wr, **({"SPLIT": split} if split > 1 else {})}


def smem_bytes(knobs: dict, d: int) -> int:
    """The query rows, then two stages of K and V tiles, which the key warps' merge reuses."""
    rows, wk = knobs["WR"] * knobs["MT"] * 16, knobs["NW"] // knobs["WR"]
    keys = 4 * wk * knobs["BN"] * (d + PAD) * 2
    return rows * (d + PAD) * 2 + max(keys, wk * rows * (d + 2) * 4)


def valid(knobs: dict) -> bool:
    """Whether the NW warps split into WR row warps of MT (1 or 2) 16-row MMA tiles and key warps
    of BN keys (a multiple of 16), within the shared memory at the largest head dim."""
    nw, wr = knobs["NW"], knobs["WR"]
    return nw % wr == 0 and knobs["MT"] in (1, 2) and knobs["BN"] % 16 == 0 and knobs["BN"] > 0 \
        and smem_bytes(knobs, max(HEAD_DIMS)) <= MAX_SMEM and knobs.get("SPLIT", 1) >= 1


def space(level: int) -> list[dict]:
    """Level 0: four key warps of 16 keys each over 16 rows, the keys split four ways; 1: that
    tile unsplit and split 2 to 16 ways, 32-key warps, eight warps, 32 to 128 rows; 2: more of
    each."""
    if level == 0:
        return [_k(16, 4, 1, 1, 4)]
    out = [_k(16, 4, 1, 1, s) for s in (1, 2, 4, 8, 16)]
    out += [_k(32, 4, 1, 1, 4), _k(16, 8, 1, 1, 4), _k(16, 4, 2, 1, 4), _k(32, 4, 2, 2, 4), _k(64, 4, 2, 4, 2)]
    if level == 2:
        out += [_k(16, 2, 1, 1, 8), _k(32, 4, 1, 1, 8), _k(16, 8, 2, 2, 4), _k(32, 8, 1, 2, 8), _k(64, 4, 1, 4, 4),
                _k(16, 4, 1, 1, 32)]
    return out


def applies(task) -> bool:
    """Attention tasks of at most MAX_QUERIES queries against at least MIN_KEYS keys that
    `attention_flash` would take (16-bit, its head dims, D == Dv)."""
    a = match_attention(task)
    return (a is not None and a.dtype in (dtypes.float16, dtypes.bfloat16)
            and a.q.dtype == a.k.dtype == a.v.dtype and a.D == a.Dv and a.D in HEAD_DIMS
            and a.Lq <= MAX_QUERIES and a.Lk >= MIN_KEYS)


def _keys(a: Attention) -> int:
    """The keys any query sees: causal attention's end at the last query."""
    return min(a.Lk, a.Lq) if a.causal else a.Lk


def suggest(task, sm_count: int) -> list[dict]:
    """Rows packed into one row block where they fit (up to 128 rows on four row warps), keys
    64 a tile over the remaining warps; the keys split so that the grid has up to
    CTAS_PER_SM CTAs a multiprocessor, each share at least two tiles and none empty
    (`kiln_attention_combine` merges the shares); then `space(1)`. Symbolic sizes count as their bucket
    (`split_k.bucket`), so that the lengths of a bucket share one source."""
    a = match_attention(task)
    Lq, batch = bucket(a.Lq), bucket(a.batch_count)
    rows = a.group * Lq
    mt, wr = (1, 1) if rows <= 16 else (2, 1) if rows <= 32 else (2, 2) if rows <= 64 else (2, 4)
    nw = 4
    bn = 64 // (nw // wr)
    knobs = _k(bn, nw, mt, wr)
    ctas = batch // a.group * -(-rows // (wr * mt * 16))
    tiles = -(-bucket(_keys(a)) // 64)
    split = max(1, min(CTAS_PER_SM * sm_count // ctas, tiles // 2))
    split = -(-tiles // -(-tiles // split))
    first = _k(bn, nw, mt, wr, split)
    return [first] + [k for k in space(1) if k != first]


def render(task, BN, NW, MT, WR, SPLIT=1) -> CudaProgram:
    """The decode kernel for `task` (see the module doc), and `kiln_attention_combine` after it
    when SPLIT > 1."""
    a: Attention = match_attention(task)
    knobs = _k(BN, NW, MT, WR, SPLIT)
    if not valid(knobs):
        raise ValueError(f"attention_decode: invalid knobs {knobs} (NW warps = WR row warps of MT = 1 or 2 "
                         f"16-row tiles x key warps of BN keys, a multiple of 16; at most {MAX_SMEM} bytes of "
                         f"shared memory; SPLIT >= 1)")
    rows, row_block, wk = a.group * a.Lq, WR * MT * 16, NW // WR
    row_blocks, kt = (rows + row_block - 1) // row_block, wk * BN
    args, temporaries, params, launches = tuple(a.args.split(", ")), [], a.params, []
    defines = {
        **a.device_defines(), **strides(a), "BATCH": a.text(a.batch_count), "Q_PARAM": a.q.param,
        "Q_BASE": a.base(a.q, "qbh"), "WR": WR, "WK": wk, "KT": kt, "ROW_BLOCK": row_block,
        "ROW_BLOCKS": a.int_text(row_blocks), "QUERY_ROWS": a.int_text(rows), "GROUP": a.group,
        "TILES_PER_SPLIT": a.int_text(((_keys(a) + kt - 1) // kt + SPLIT - 1) // SPLIT), **UNSPLIT,
    }
    kernels = [CODE, program("kiln_attention_decode_program", a, {"BN": BN, "NT": NW * 32, "MT": MT, "SPLIT": SPLIT},
                             i="r % LQ", bh="bh * GROUP + r / LQ", ok="r < QUERY_ROWS"), KERNEL]
    if SPLIT > 1:
        sk = split_kv(a, SPLIT, params, args)
        params, args, temporaries = sk.params, sk.args, sk.temporaries
        defines.update(sk.defines)
        kernels += sk.kernels
        launches.append(sk.combine)
    defines["KERNEL_PARAMS"] = params
    source = template_source(kernels, defines, a.hooks, (ptx.CP_ASYNC, ptx.LDMATRIX, ptx.MMA, ptx.CVT_EX2))
    blocks = int(SPLIT * row_blocks * (a.batch_count // a.group))
    launches.insert(0, Launch("kiln_attention_decode", args, (NW * 32, 1, 1), grid=(blocks, 1, 1),
                              smem=smem_bytes(knobs, a.D)))
    return CudaProgram(source, launches, temporaries, alignment=16, sizes=a.sizes.values)


TEMPLATE = Template("attention_decode", ("attention",), "cuda", render, priority=20, applies=applies, space=space,
                    suggest=suggest, reads_views=True, symbolic=True)
