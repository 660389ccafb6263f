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
with this tile step (`kiln_attend`, its rows mapped to queries by the QUERY_* macros) and this
merge.

The task is read by `attention_match.match_attention`: q, k and v straight from their inputs
(any strides of whole 16-byte chunks, so a [B, L, H, D] view needs no copy; key/value head
h // group for grouped-query attention), the mask through the core-rendered hook `kiln_mask`,
and the output through the epilogue hooks, where fused epilogues go.
Symbolic sizes (sequence lengths, a KV cache, a batch) are kernel arguments (`Attention.sizes`);
`suggest` buckets them by powers of two, so the lengths of a bucket share one source.
"""
from __future__ import annotations

import math
from typing import NamedTuple

from kiln.template import CudaProgram, KernelArgs, Launch, Template, dtypes, ptx, template_source
from kiln_ops_builtin.templates.attention_match import Attention, match_attention
from kiln_ops_builtin.templates.attention_softmax import ONLINE_SOFTMAX
from kiln_ops_builtin.templates.split_k import bucket

MAX_SMEM = 227 * 1024
HEAD_DIMS = (64, 80, 96, 128)
PAD = 8                                   # elements of padding per shared-memory row (16 bytes)

DEVICE = ONLINE_SOFTMAX + r"""
// ROWS rows of a [rows, D] operand from `src` (rows at `stride`) into a padded tile; with CHECK,
// rows from `valid` on are zero-filled (without, all are in range). Where the threads cover
// whole rows (NT a multiple of D / 8), each copies one column chunk of every STEP-th row from
// a base address of its own, so that its copies differ by constant offsets.
template <int ROWS, bool CHECK>
static __device__ __forceinline__ void kiln_load_rows(uint16_t* dst, const uint16_t* src, int64_t stride, int valid,
                                                      int tid) {
    constexpr int CH = D / 8, TOTAL = ROWS * CH, STEP = NT / CH;
    if (NT % CH == 0 && ROWS % STEP == 0) {
        const int r0 = tid / CH, c = tid % CH;
        const uint16_t* g = src + r0 * stride + c * 8;
        uint16_t* s = dst + r0 * LDS + c * 8;
#pragma unroll
        for (int n = 0; n < ROWS / STEP; ++n) {
            if (!CHECK || r0 + n * STEP < valid) kiln_cp_async16(s + n * STEP * LDS, g + n * STEP * stride, 16);
            else kiln_cp_async16(s + n * STEP * LDS, src, 0);
        }
        return;
    }
#pragma unroll
    for (int n = 0; n < (TOTAL + NT - 1) / NT; ++n) {
        const int idx = tid + n * NT;
        if (TOTAL % NT == 0 || idx < TOTAL) {
            const int r = idx / CH, c = idx % CH;
            const bool ok = !CHECK || r < valid;
            kiln_cp_async16(dst + r * LDS + c * 8, ok ? src + r * stride + c * 8 : src, ok ? 16 : 0);
        }
    }
}

// Keys n0 .. n0 + ROWS of K and V (rows at K_RS, V_RS) into the tiles `ks` and `vs`, rows past LK
// zero-filled (PARAMS: the kernel's, which the sizes may read).
template <int ROWS>
static __device__ __forceinline__ void kiln_load_keys(uint16_t* ks, uint16_t* vs, const uint16_t* K, const uint16_t* V,
                                                      int n0, int tid, PARAMS) {
    if (n0 + ROWS <= LK) {
        kiln_load_rows<ROWS, false>(ks, K + n0 * K_RS, K_RS, ROWS, tid);
        kiln_load_rows<ROWS, false>(vs, V + n0 * V_RS, V_RS, ROWS, tid);
    } else {
        kiln_load_rows<ROWS, true>(ks, K + n0 * K_RS, K_RS, LK - n0, tid);
        kiln_load_rows<ROWS, true>(vs, V + n0 * V_RS, V_RS, LK - n0, tid);
    }
}

// A warp's online-softmax state before its first key: outputs 0, row maxima -inf, sums 0.
static __device__ __forceinline__ void kiln_start_rows(float (&o)[MT][D / 2], float (&mx)[MT][2], float (&sum)[MT][2]) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int e = 0; e < D / 2; ++e) o[mt][e] = 0.f;
        mx[mt][0] = mx[mt][1] = -INFINITY;
        sum[mt][0] = sum[mt][1] = 0.f;
    }
}

// One key tile (keys n0 .. n0 + BN) for a warp's MT * 16 tile rows from row0: S = Q K^T, the
// online softmax (`kiln_softmax_step`), O += P V. Tile row r is query QUERY_I(r) of flat batch
// QUERY_BH(bh, r), a real query where QUERY_OK(r). EDGE: some key of the tile is past LK or
// (causal) after a row.
template <bool EDGE>
static __device__ __forceinline__ void kiln_attend(float (&o)[MT][D / 2], float (&mx)[MT][2], float (&sum)[MT][2],
                                                   const uint16_t* qs, const uint16_t* ks, const uint16_t* vs,
                                                   int row0, int n0, int64_t bh, int lane, PARAMS) {
    float s[MT][BN / 2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int e = 0; e < BN / 2; ++e) s[mt][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        unsigned qf[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
            kiln_ldmatrix_x4(qf[mt], qs + (mt * 16 + (lane & 15)) * LDS + (kk * 2 + (lane >> 4)) * 8);
#pragma unroll
        for (int j = 0; j < BN / 16; ++j) {
            unsigned t[4];
            kiln_ldmatrix_x4(t, ks + (j * 16 + (lane >> 4) * 8 + (lane & 7)) * LDS + (kk * 2 + ((lane >> 3) & 1)) * 8);
            const unsigned b0[2] = {t[0], t[1]}, b1[2] = {t[2], t[3]};
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                MMA(&s[mt][8 * j], qf[mt], b0);
                MMA(&s[mt][8 * j + 4], qf[mt], b1);
            }
        }
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        float alpha[2];
        kiln_softmax_step<EDGE, BN / 8>(s[mt], mx[mt], sum[mt], alpha, row0 + mt * 16, n0, bh, lane, ARGS);
        kiln_rescale_rows<D / 8>(o[mt], alpha);
    }
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
        unsigned pa[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            pa[mt][0] = PACK(s[mt][8 * kk], s[mt][8 * kk + 1]);
            pa[mt][1] = PACK(s[mt][8 * kk + 2], s[mt][8 * kk + 3]);
            pa[mt][2] = PACK(s[mt][8 * kk + 4], s[mt][8 * kk + 5]);
            pa[mt][3] = PACK(s[mt][8 * kk + 6], s[mt][8 * kk + 7]);
        }
#pragma unroll
        for (int j = 0; j < D / 16; ++j) {
            unsigned t[4];
            kiln_ldmatrix_x4_trans(t, vs + (kk * 16 + (lane & 15)) * LDS + (j * 2 + (lane >> 4)) * 8);
            const unsigned b0[2] = {t[0], t[1]}, b1[2] = {t[2], t[3]};
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                MMA(&o[mt][8 * j], pa[mt], b0);
                MMA(&o[mt][8 * j + 4], pa[mt], b1);
            }
        }
    }
}

// The merge of `count` partial results of one row, share s having its maximum and sum at
// stats[s * stats_step] and its unnormalized values n, n + 1 at part[s * part_step]: each
// rescaled to the largest maximum among the shares that saw a key (sum > 0), which goes to
// `top` (-inf where none did), their rescaled sum to `total`; returns the merged values.
static __device__ __forceinline__ float2 kiln_merge_shares(int count, const float* stats, int64_t stats_step,
                                                           const float* part, int64_t part_step, float& top,
                                                           float& total) {
    top = -INFINITY;
    for (int s = 0; s < count; ++s) {
        const float2 st = *(const float2*)&stats[s * stats_step];
        if (st.y > 0.f) top = fmaxf(top, st.x);
    }
    float l = 0.f, o0 = 0.f, o1 = 0.f;
    for (int s = 0; s < count; ++s) {
        const float2 st = *(const float2*)&stats[s * stats_step];
        if (st.y > 0.f) {
            const float f = kiln_ex2(st.x - top);
            const float2 p = *(const float2*)&part[s * part_step];
            l += st.y * f;
            o0 += p.x * f;
            o1 += p.y * f;
        }
    }
    total = l;
    return make_float2(o0, o1);
}
"""

KERNEL = r"""
extern "C" __global__ void __launch_bounds__(NT) kiln_attention_flash(KERNEL_PARAMS) {
    extern __shared__ __align__(128) unsigned char kiln_smem[];
    uint16_t* Qs = (uint16_t*)kiln_smem;
    uint16_t* Ks = Qs + BM * LDS;
    uint16_t* Vs = Ks + 2 * BN * LDS;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int sp = (int)(blockIdx.x % SPLIT);                 // the CTA's share of the keys
    const int64_t rest = blockIdx.x / SPLIT, bh = rest / M_BLOCKS;
    const int mb = CAUSAL ? M_BLOCKS - 1 - (int)(rest % M_BLOCKS) : (int)(rest % M_BLOCKS);
    const int m0 = mb * BM, row0 = m0 + warp * MT * 16;
    const uint16_t* Q = (const uint16_t*)Q_PARAM + (Q_BASE);
    const uint16_t* K = (const uint16_t*)K_PARAM + (K_BASE);
    const uint16_t* V = (const uint16_t*)V_PARAM + (V_BASE);
    const int keys = CAUSAL ? min(LK, m0 + BM) : LK;
    const int tiles = (keys + BN - 1) / BN;
    const int t0 = min(tiles, sp * TILES_PER_SPLIT), t1 = min(tiles, t0 + TILES_PER_SPLIT);
    if (m0 + BM <= LQ) kiln_load_rows<BM, false>(Qs, Q + m0 * Q_RS, Q_RS, BM, tid);
    else kiln_load_rows<BM, true>(Qs, Q + m0 * Q_RS, Q_RS, LQ - m0, tid);
    auto load_keys = [&](int stage, int n0) {
        kiln_load_keys<BN>(Ks + stage * BN * LDS, Vs + stage * BN * LDS, K, V, n0, tid, ARGS);
    };
    if (t0 < t1) load_keys(0, t0 * BN);
    kiln_cp_async_commit();
    float o[MT][D / 2], mx[MT][2], sum[MT][2];
    kiln_start_rows(o, mx, sum);
    const uint16_t* qs = Qs + warp * MT * 16 * LDS;
    for (int t = t0; t < t1; ++t) {
        if (t + 1 < t1) load_keys((t + 1 - t0) & 1, (t + 1) * BN);
        kiln_cp_async_commit();
        kiln_cp_async_wait<1>();
        __syncthreads();
        const int n0 = t * BN;
        const uint16_t* ks = Ks + ((t - t0) & 1) * BN * LDS;
        const uint16_t* vs = Vs + ((t - t0) & 1) * BN * LDS;
        // a warp skips tiles whose keys all follow its rows, and rows all past LQ (decoding)
        if (row0 < LQ && (!CAUSAL || n0 <= row0 + MT * 16 - 1)) {
            if (n0 + BN > LK || (CAUSAL && n0 + BN - 1 > row0))
                kiln_attend<true>(o, mx, sum, qs, ks, vs, row0, n0, bh, lane, ARGS);
            else
                kiln_attend<false>(o, mx, sum, qs, ks, vs, row0, n0, bh, lane, ARGS);
        }
        __syncthreads();
    }
    kiln_cp_async_wait<0>();        // an empty share's query copies
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#if SPLIT > 1
        // partial results: O unnormalized, relative to the row maximum, with maximum and sum
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float total = kiln_quad_sum(sum[mt][h]);
            const int64_t i = row0 + mt * 16 + (lane >> 2) + h * 8;
            if (i >= LQ) continue;
            const int64_t row = ((int64_t)sp * BATCH + bh) * LQ + i;
#pragma unroll
            for (int dt = 0; dt < D / 8; ++dt)
                *(float2*)&PART[row * D + dt * 8 + (lane & 3) * 2] =
                    make_float2(o[mt][dt * 4 + 2 * h], o[mt][dt * 4 + 2 * h + 1]);
            if ((lane & 3) == 0) *(float2*)&STATS[row * 2] = make_float2(mx[mt][h], total);
        }
#else
        kiln_store_rows<D / 8>(o[mt], sum[mt], row0 + mt * 16, bh, lane, ARGS);
#endif
    }
}
"""

COMBINE = r"""
// out[bh, i, n..n+1] from the SPLIT partial results of row (bh, i) ([SPLIT][BATCH][LQ][D] values
// in PART, [SPLIT][BATCH][LQ][2] maxima and sums in STATS); zeros where no split saw a key
extern "C" __global__ void __launch_bounds__(256) kiln_attention_combine(KERNEL_PARAMS) {
    const int64_t rows = (int64_t)BATCH * LQ, items = rows * (D / 2);
    for (int64_t idx = (int64_t)blockIdx.x * 256 + threadIdx.x; idx < items; idx += (int64_t)gridDim.x * 256) {
        const int64_t row = idx / (D / 2), n = idx % (D / 2) * 2;
        float top, l;
        const float2 o = kiln_merge_shares(SPLIT, STATS + row * 2, rows * 2, PART + row * D + n, rows * D, top, l);
        const float inv = l == 0.f ? 0.f : 1.f / l;
        kiln_epilogue2(ARGS, row / LQ, row % LQ, n, o.x * inv, o.y * inv);
    }
}
"""


class SplitKV(NamedTuple):
    """What splitting the keys `SPLIT` ways adds to an attention program."""

    params: str               # the kernel parameters, the temporaries' appended
    args: tuple               # the kernel arguments, likewise
    temporaries: list         # float32 [SPLIT][BATCH][LQ][D] values and [SPLIT][BATCH][LQ][2] maxima and sums
    defines: dict             # PART and STATS, the temporaries' names
    kernels: list             # COMBINE's source (it needs DEVICE's `kiln_merge_shares`)
    combine: Launch           # `kiln_attention_combine`, after the attention kernel


def split_kv(a: Attention, split: int, params: str, args: tuple) -> SplitKV:
    """The partial results of `split` key shares of `a` and the kernel that merges them: each
    share writes its rows' unnormalized values relative to their maximum (log2 domain), the
    maximum and the sum, and `kiln_attention_combine` stores the merged rows through the
    epilogue hooks."""
    part, stats = KernelArgs.temporary(0), KernelArgs.temporary(1)
    rows = (split, int(a.batch_count), int(a.Lq))
    temporaries = [(rows + (a.D,), dtypes.float32), (rows + (2,), dtypes.float32)]
    args = args + (part, stats)
    combine = Launch("kiln_attention_combine", args, (256, 1, 1), items=int(a.batch_count * a.Lq * a.D // 2),
                     per_block=256, waves=8)
    return SplitKV(params + f", float* __restrict__ {part}, float* __restrict__ {stats}", args, temporaries,
                   {"PART": part, "STATS": stats}, [COMBINE], combine)


def operand_defines(a: Attention, q_flat: str, kv_flat: str) -> dict:
    """The #defines every attention kernel reads: sizes, mask, causality, scale (in the log2
    domain; RAW_MAX: the row maximum is taken before scaling, as a positive scale without a
    float mask allows), the operands' inputs, bases (Q_BASE for the flat query batch index
    named `q_flat`, K_BASE and V_BASE for `kv_flat`) and row strides, and for 16-bit types the
    MMA and packing wrappers of the dtype."""
    return {
        "D": a.D, "LDS": a.D + PAD, "LQ": a.int_text(a.Lq), "LK": a.int_text(a.Lk), "BATCH": a.text(a.batch_count),
        "CAUSAL": int(a.causal),
        "HAS_MASK": int(a.mask is not None), "MASK_BOOL": int(a.mask == "bool"),
        "RAW_MAX": int(a.scale > 0 and a.mask != "float"),
        "SCALE_LOG2": f"{a.scale * math.log2(math.e)!r}f", "PARAMS": a.params, "ARGS": a.args,
        "Q_PARAM": a.q.param, "K_PARAM": a.k.param, "V_PARAM": a.v.param,
        "Q_BASE": a.base(a.q, q_flat), "K_BASE": a.base(a.k, kv_flat), "V_BASE": a.base(a.v, kv_flat),
        "Q_RS": f"(int64_t){a.text(a.q.row_stride)}", "K_RS": f"(int64_t){a.text(a.k.row_stride)}",
        "V_RS": f"(int64_t){a.text(a.v.row_stride)}",
        **({"MMA": ptx.mma_m16n8k16(a.dtype), "PACK": ptx.pack_16x2(a.dtype)} if a.dtype.is_16bit_float else {}),
    }


def smem_bytes(knobs: dict, d: int) -> int:
    return (knobs["BM"] + 4 * knobs["BN"]) * (d + PAD) * 2


def valid(knobs: dict) -> bool:
    """Whether BM splits into NW warps of one or two 16-row MMA tiles each, and fits the largest head dim."""
    bm, bn, nw = knobs["BM"], knobs["BN"], knobs["NW"]
    return bm % (16 * nw) == 0 and bm // (16 * nw) in (1, 2) and bn % 16 == 0 \
        and smem_bytes(knobs, max(HEAD_DIMS)) <= MAX_SMEM and knobs.get("SPLIT", 1) >= 1


def _k(bm, bn, nw, split=1) -> dict:
    return {"BM": bm, "BN": bn, "NW": nw, **({"SPLIT": split} if split > 1 else {})}


def space(level: int) -> list[dict]:
    """Level 0: 128 queries on four warps (32 rows each), 64-key tiles, the best or within 2% of
    it on the long sequences of benchmarks/attention_bench.py's sweep on an H200 (head dims 64
    to 128, causal or not); 1: query and key tile sizes and warp counts around it, and
    split-KV; 2: every valid combination, and more splits."""
    if level == 0:
        return [_k(128, 64, 4)]
    if level == 1:
        return [_k(128, 64, 4), _k(128, 64, 8), _k(128, 32, 4), _k(64, 64, 4), _k(128, 128, 8), _k(64, 32, 4),
                _k(64, 64, 4, 3)]
    tiles = [k for bm in (64, 128) for bn in (32, 64, 128) for nw in (2, 4, 8) if valid(k := _k(bm, bn, nw))]
    return tiles + [_k(64, 64, 4, split) for split in (2, 4, 8, 16)]


def applies(task) -> bool:
    a = match_attention(task)
    return (a is not None and a.dtype in (dtypes.float16, dtypes.bfloat16)
            and a.q.dtype == a.k.dtype == a.v.dtype and a.D == a.Dv and a.D in HEAD_DIMS)


def suggest(task, sm_count: int) -> list[dict]:
    """Level 0 by shape. Decoding (at most 16 queries, at least 16 key tiles) splits the keys
    over enough CTAs for eight a multiprocessor, each at least four tiles (`COMBINE` merges the
    shares); 64-query blocks on four warps for at most 64 queries or where 128-query blocks
    would not fill the GPU (short sequences); else `space(0)`'s. Symbolic sizes count as their
    bucket (`split_k.bucket`), so that the sizes of a bucket share one source."""
    a = match_attention(task)
    Lq, Lk, batch = (bucket(x) for x in (a.Lq, a.Lk, a.batch_count))
    tiles = -(-Lk // 64)
    if Lq <= 16 and tiles >= 16:
        split = min(-(-8 * sm_count // batch), tiles // 4)
        return [_k(64, 64, 4, split)]
    if Lq <= 64 or -(-Lq // 128) * batch < sm_count:
        return [_k(64, 64, 4)]
    return space(0)


def render(task, BM, BN, NW, SPLIT=1) -> CudaProgram:
    a: Attention = match_attention(task)
    knobs = _k(BM, BN, NW, SPLIT)
    if not valid(knobs):
        raise ValueError(f"attention_flash: invalid knobs {knobs} (BM = NW warps x 16 or 32 rows, BN a multiple "
                         f"of 16, at most {MAX_SMEM} bytes of shared memory, SPLIT >= 1)")
    m_blocks = (a.Lq + BM - 1) // BM
    args, kernels, temporaries, params, launches = tuple(a.args.split(", ")), [DEVICE, KERNEL], [], a.params, []
    defines = {
        **operand_defines(a, "bh", "bh"), "BM": BM, "BN": BN, "NW": NW, "NT": NW * 32, "MT": BM // (16 * NW),
        "M_BLOCKS": a.int_text(m_blocks), "SPLIT": SPLIT,
        "TILES_PER_SPLIT": a.int_text(((a.Lk + BN - 1) // BN + SPLIT - 1) // SPLIT),
        "QUERY_BH(bh, r)": "(bh)", "QUERY_I(r)": "(r)", "QUERY_OK(r)": "((r) < LQ)",
    }
    if SPLIT > 1:
        sk = split_kv(a, SPLIT, params, args)
        params, args, temporaries = sk.params, sk.args, sk.temporaries
        defines.update(sk.defines)
        kernels += sk.kernels
        launches.append(sk.combine)
    defines["KERNEL_PARAMS"] = params
    source = template_source(kernels, defines, a.hooks, (ptx.CP_ASYNC, ptx.LDMATRIX, ptx.MMA, ptx.CVT_EX2))
    blocks = int(SPLIT * m_blocks * a.batch_count)
    launches.insert(0, Launch("kiln_attention_flash", args, (NW * 32, 1, 1), grid=(blocks, 1, 1),
                              smem=smem_bytes(knobs, a.D)))
    return CudaProgram(source, launches, temporaries, alignment=16, sizes=a.sizes.values)


TEMPLATE = Template("attention_flash", ("attention",), "cuda", render, priority=10, applies=applies, space=space,
                    suggest=suggest, reads_views=True, symbolic=True)
