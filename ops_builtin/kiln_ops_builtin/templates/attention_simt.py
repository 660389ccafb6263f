"""Fused attention in float32 on CUDA cores (any sm_70+): the online softmax of FlashAttention
without tensor cores, for the float32 models the 16-bit templates do not take (BERT at float32).

A CTA owns BM = NW * R queries of one (batch, head): each of its NW warps R query rows. It walks
the keys 32 at a time: the tile's K and V rows go to shared memory (K's rows padded by one
float, so that lane j reading row j stays in its own bank), and per query row lane j computes
the score of key j (a dot product over D, the query read from shared memory as a broadcast),
scaled into the log2 domain, masked (the mask hook; keys past LK and, causal, after the query),
then the warp takes the row's new maximum and sum by shuffles, and each lane adds the tile's
p_j V[j] to the output columns it owns (pairs 2 * lane + 64 * c). A fully masked row keeps sum 0
and gets zeros, as the operator defines. Causal attention skips the tiles after the CTA's last
query. Outputs go through the epilogue hooks (`kiln_epilogue2`), where fused epilogues go.

The task is read by `attention_match.match_attention`, as for `attention_flash`: q, k and v
straight from their inputs (a [B, L, H, D] view needs no copy; key/value head h // group for
grouped-query attention). Symbolic sizes are kernel arguments; `suggest` buckets them.
"""
from __future__ import annotations

from kiln.template import CudaProgram, Launch, Template, dtypes, template_source
from kiln_ops_builtin.templates.attention_flash import operand_defines
from kiln_ops_builtin.templates.attention_match import Attention, match_attention
from kiln_ops_builtin.templates.split_k import bucket

BN = 32                       # keys per tile: one per lane
MAX_D = 128                   # output columns: two per lane per 64

KERNEL = r"""
extern "C" __global__ void __launch_bounds__(NW * 32) kiln_attention_simt(KERNEL_PARAMS) {
    extern __shared__ __align__(16) float kiln_smem_f[];
    float* Qs = kiln_smem_f;                        // [BM][D]
    float* Ks = Qs + BM * D;                        // [BN][D + 1]
    float* Vs = Ks + BN * (D + 1);                  // [BN][DP]
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int64_t bh = blockIdx.x / M_BLOCKS;
    const int mb = CAUSAL ? M_BLOCKS - 1 - (int)(blockIdx.x % M_BLOCKS) : (int)(blockIdx.x % M_BLOCKS);
    const int m0 = mb * BM;
    const float* Q = (const float*)Q_PARAM + (Q_BASE);
    const float* K = (const float*)K_PARAM + (K_BASE);
    const float* V = (const float*)V_PARAM + (V_BASE);
    for (int e = tid; e < BM * D; e += NW * 32) {
        const int r = e / D, c = e % D;
        Qs[e] = m0 + r < LQ ? Q[(int64_t)(m0 + r) * Q_RS + c] : 0.f;
    }
    float o[R][DP / 64][2], mx[R], sum[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        mx[r] = -INFINITY;
        sum[r] = 0.f;
#pragma unroll
        for (int c = 0; c < DP / 64; ++c) o[r][c][0] = o[r][c][1] = 0.f;
    }
    const int keys = CAUSAL ? min(LK, m0 + BM) : LK;
    for (int n0 = 0; n0 < keys; n0 += BN) {
        __syncthreads();                            // the previous tile's readers are done
        for (int e = tid; e < BN * DP; e += NW * 32) {      // keys past LK, and V's columns past D: zeros
            const int j = e / DP, c = e % DP;
            const bool in = n0 + j < LK && c < D;
            if (c < D) Ks[j * (D + 1) + c] = in ? K[(int64_t)(n0 + j) * K_RS + c] : 0.f;
            Vs[j * DP + c] = in ? V[(int64_t)(n0 + j) * V_RS + c] : 0.f;
        }
        __syncthreads();
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const int row = warp * R + r, i = m0 + row, j = n0 + lane;
            if (i >= LQ) continue;
            float s = 0.f;
#pragma unroll 8
            for (int c = 0; c < D; ++c) s = fmaf(Qs[row * D + c], Ks[lane * (D + 1) + c], s);
            float x = s * SCALE_LOG2;
#if HAS_MASK
            if (j < LK) {
#if MASK_BOOL
                if (!kiln_mask(ARGS, bh, i, j)) x = -INFINITY;
#else
                x += kiln_mask(ARGS, bh, i, j) * 1.4426950408889634f;
#endif
            }
#endif
            if (j >= LK || (CAUSAL && j > i)) x = -INFINITY;
            float top = x;
#pragma unroll
            for (int m = 16; m > 0; m >>= 1) top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, m));
            const float now = fmaxf(mx[r], top);
            const float shift = now == -INFINITY ? 0.f : now;     // a row masked so far stays at sum 0
            const float alpha = exp2f(mx[r] - shift);
            const float p = exp2f(x - shift);
            float part = p;
#pragma unroll
            for (int m = 16; m > 0; m >>= 1) part += __shfl_xor_sync(0xffffffffu, part, m);
            mx[r] = now;
            sum[r] = sum[r] * alpha + part;
#pragma unroll
            for (int c = 0; c < DP / 64; ++c) {
                o[r][c][0] *= alpha;
                o[r][c][1] *= alpha;
            }
#pragma unroll 8
            for (int k = 0; k < BN; ++k) {
                const float pk = __shfl_sync(0xffffffffu, p, k);
#pragma unroll
                for (int c = 0; c < DP / 64; ++c) {
                    const float2 v = *(const float2*)&Vs[k * DP + c * 64 + 2 * lane];
                    o[r][c][0] = fmaf(pk, v.x, o[r][c][0]);
                    o[r][c][1] = fmaf(pk, v.y, o[r][c][1]);
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const int64_t i = m0 + warp * R + r;
        if (i >= LQ) continue;
        const float inv = sum[r] == 0.f ? 0.f : 1.f / sum[r];
#pragma unroll
        for (int c = 0; c < DP / 64; ++c) {
            const int d = c * 64 + 2 * lane;
            if (d < D) kiln_epilogue2(ARGS, bh, i, d, o[r][c][0] * inv, o[r][c][1] * inv);
        }
    }
}
"""


def _k(nw: int, r: int) -> dict:
    return {"NW": nw, "R": r}


def padded(d: int) -> int:
    """V's row length in shared memory: the head dim in whole 64-column blocks (two per lane)."""
    return -(-d // 64) * 64


def smem_bytes(knobs: dict, d: int) -> int:
    return 4 * (knobs["NW"] * knobs["R"] * d + BN * (d + 1) + BN * padded(d))


def space(level: int) -> list[dict]:
    """Level 0: four warps of four query rows; 1 and 2: 4 or 8 warps of 1, 2 or 4 rows."""
    if level == 0:
        return [_k(4, 4)]
    return [_k(nw, r) for nw in (4, 8) for r in (1, 2, 4)]


def applies(task) -> bool:
    """float32 attention with D == Dv, even and at most MAX_D (the 16-bit types are the
    tensor-core templates')."""
    a = match_attention(task)
    return (a is not None and a.dtype == dtypes.float32 and a.q.dtype == a.k.dtype == a.v.dtype == dtypes.float32
            and a.D == a.Dv and a.D % 2 == 0 and a.D <= MAX_D)


def suggest(task, sm_count: int) -> list[dict]:
    """Four warps of four rows where that gives a CTA per multiprocessor, else of fewer rows (short
    sequences, few heads); symbolic sizes count as their bucket, so a bucket shares one source."""
    a = match_attention(task)
    Lq, batch = bucket(a.Lq), bucket(a.batch_count)
    for r in (4, 2, 1):
        if -(-Lq // (4 * r)) * batch >= sm_count:
            return [_k(4, r)] + [k for k in space(1) if k != _k(4, r)]
    return [_k(4, 1)] + [k for k in space(1) if k != _k(4, 1)]


def render(task, NW, R) -> CudaProgram:
    """The kernel for `task` (see the module doc): NW warps of R query rows a CTA."""
    a: Attention = match_attention(task)
    if NW not in (1, 2, 4, 8) or R not in (1, 2, 4):
        raise ValueError(f"attention_simt: invalid knobs NW={NW}, R={R} (NW 1, 2, 4 or 8 warps; R 1, 2 or 4 rows)")
    bm = NW * R
    m_blocks = (a.Lq + bm - 1) // bm
    defines = {**operand_defines(a, "bh", "bh"), "NW": NW, "R": R, "BM": bm, "BN": BN, "DP": padded(a.D),
               "M_BLOCKS": a.int_text(m_blocks), "KERNEL_PARAMS": a.params}
    source = template_source([KERNEL], defines, a.hooks, ())
    launch = Launch("kiln_attention_simt", tuple(a.args.split(", ")), (NW * 32, 1, 1),
                    grid=(int(m_blocks * a.batch_count), 1, 1), smem=smem_bytes(_k(NW, R), a.D))
    return CudaProgram(source, [launch], alignment=16, sizes=a.sizes.values)


TEMPLATE = Template("attention_simt", ("attention",), "cuda", render, priority=10, applies=applies, space=space,
                    suggest=suggest, reads_views=True, symbolic=True)
