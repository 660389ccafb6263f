"""Fused attention on the CPU: softmax(q k^T * scale + mask) v in one pass over the keys per
block of queries (the online softmax of FlashAttention), float32 inside for float32, float16
and bfloat16 inputs.

The threads share out (flat batch, block of BM queries) items. An item copies its queries once
into a float32 buffer [BM][D], then walks the keys BN at a time (causal attention stops at its
last query's diagonal): it copies the block's keys transposed into [D][BN] and its values into
[BN][DVP] (float32, zero-padded to whole vectors), computes the scores with a register-blocked
micro-kernel (`kiln_product`: MR queries by 2 vectors of keys, the query element broadcast
against the keys' vectors), scales them, applies the mask (`kiln_mask`, rendered by the core from whatever
computes it: a bool keeps, a float adds), the causal edge and the key count, and runs the
online softmax per query row (running maximum and sum in float32, `kiln_vexp` on whole
vectors, the row's accumulated output rescaled where the maximum moves); then the same
micro-kernel adds P V into the row outputs [BM][DVP]. A row whose keys were all masked
keeps sum 0 and gets zeros, as the operator defines. Each finished row goes out through the
core's row epilogue (`kiln_epilogue_row`), where fused epilogues (casts, a transpose and
reshape back to [B, L, H * D]) go.

The task is read by `attention_match.match_attention(task, "cpu")`: q, k and v straight from
their inputs with any strides but a unit column stride (head-transposed views need no copy;
grouped-query heads read key/value head h // group); it declines anything else (a computed
operand, float64), which the auto-scheduler keeps. Its sizes are the task's own
(`fixed_sizes_only`): attention of symbolic sizes (a growing KV cache, dynamic=True) stays with
the auto-scheduler, whose one build serves every size.
"""
from __future__ import annotations

from kiln.template import C_PRELUDE, CpuProgram, KernelArgs, Template, dtypes

from kiln_ops_builtin.templates.attention_match import Attention, match_attention
from kiln_ops_builtin.templates.cpu_simd import VECTORS

KERNEL = r"""
#include <omp.h>
#if VW == 16
#define MR 8
#else
#define MR 4
#endif
#define NR (2 * VW)                                   /* keys (scores) or value columns (P V) per micro-tile */
#define KILN_ROUND(x, r) (((x) + (r) - 1) / (r) * (r))
#define DVP KILN_ROUND(DV, NR)
#define KILN_MIN(a, b) ((a) < (b) ? (a) : (b))
static inline float* kiln_alloc(int64_t floats) { return (float*)aligned_alloc(64, (size_t)(floats * 4 + 127) / 64 * 64); }

/* c[i][j] = scale * (c[i][j] where `add`, else 0) + sum_k a[i][k] b[k][j] for rows 0 .. rows (a
   multiple of MR) of a and c and columns 0 .. cols (a multiple of NR) of b and c: MR x NR tiles in
   registers, a's element broadcast against b's vectors. Scores: a = Q, b = K^T; P V: a = P, b = V. */
static inline void kiln_product(const float* __restrict__ a, int64_t lda, const float* __restrict__ b, int64_t ldb,
                                int64_t depth, float* __restrict__ c, int64_t ldc, int64_t rows, int64_t cols,
                                float scale, int add) {
    for (int64_t i = 0; i < rows; i += MR)
        for (int64_t j = 0; j < cols; j += NR) {
            kiln_vf acc[MR][2];
#pragma GCC unroll 16
            for (int r = 0; r < MR; ++r) {
                acc[r][0] = add ? *(const kiln_vf*)(c + (i + r) * ldc + j) : (kiln_vf){0};
                acc[r][1] = add ? *(const kiln_vf*)(c + (i + r) * ldc + j + VW) : (kiln_vf){0};
            }
            for (int64_t k = 0; k < depth; ++k) {
                const kiln_vf b0 = *(const kiln_vf*)(b + k * ldb + j), b1 = *(const kiln_vf*)(b + k * ldb + j + VW);
#pragma GCC unroll 16
                for (int r = 0; r < MR; ++r) {
                    const float x = a[(i + r) * lda + k];
                    acc[r][0] += x * b0;
                    acc[r][1] += x * b1;
                }
            }
#pragma GCC unroll 16
            for (int r = 0; r < MR; ++r) {
                *(kiln_vf*)(c + (i + r) * ldc + j) = acc[r][0] * scale;
                *(kiln_vf*)(c + (i + r) * ldc + j + VW) = acc[r][1] * scale;
            }
        }
}

/* The online softmax of query row i over the scores s[0 .. cols) of keys n0 .. n0 + cols, of
   which the first `keys` exist: masked, exponentiated in place (P), the row's maximum `top`,
   sum `total` and output row o[0 .. DVP) rescaled to the new maximum. */
static inline void kiln_softmax_row(PARAMS, int64_t bh, int64_t i, int64_t n0, int64_t keys, int64_t cols,
                                    float* __restrict__ s, float* top, float* total, float* __restrict__ o) {
    int64_t valid = keys;
    if (CAUSAL && i - n0 + 1 < valid) valid = i - n0 + 1 > 0 ? i - n0 + 1 : 0;
#if HAS_MASK
    for (int64_t j = 0; j < valid; ++j) {
#if MASK_BOOL
        if (!kiln_mask(ARGS, bh, i, n0 + j)) s[j] = -INFINITY;
#else
        s[j] += kiln_mask(ARGS, bh, i, n0 + j);
#endif
    }
#endif
    for (int64_t j = valid; j < cols; ++j) s[j] = -INFINITY;
    kiln_vf high = (kiln_vf){0} - INFINITY;
    for (int64_t j = 0; j < cols; j += VW) high = kiln_vmax(high, *(const kiln_vf*)(s + j));
    const float seen = kiln_vhmax(high), now = seen > *top ? seen : *top;
    const float shift = now == -INFINITY ? 0.f : now;       /* a row masked so far stays at sum 0 */
    const float alpha = expf(*top - shift);
    *top = now;
    kiln_vf sum = (kiln_vf){0};
    for (int64_t j = 0; j < cols; j += VW) {
        const kiln_vf p = kiln_vexp(*(const kiln_vf*)(s + j) - shift);
        *(kiln_vf*)(s + j) = p;
        sum += p;
    }
    *total = *total * alpha + kiln_vhsum(sum);
    if (alpha != 1.f)
        for (int64_t e = 0; e < DVP; e += VW) *(kiln_vf*)(o + e) *= alpha;
}

/* The item's queries i0 .. i0 + rows of flat batch bh, against every key (the causal ones: up to
   the last query's), into the buffers of the calling thread. */
static void kiln_attend(PARAMS, int64_t bh, int64_t i0, int64_t rows, float* __restrict__ qb, float* __restrict__ kt,
                        float* __restrict__ vb, float* __restrict__ s, float* __restrict__ o, float* __restrict__ top,
                        float* __restrict__ total) {
    const KILN_T* Q = (const KILN_T*)Q_PARAM + (Q_BASE) + i0 * Q_RS;
    const KILN_T* K = (const KILN_T*)K_PARAM + (K_BASE);
    const KILN_T* V = (const KILN_T*)V_PARAM + (V_BASE);
    const int64_t padded = KILN_ROUND(rows, MR);
    for (int64_t r = 0; r < padded; ++r)
        for (int64_t d = 0; d < D; ++d) qb[r * D + d] = r < rows ? KILN_LOAD(Q[r * Q_RS + d]) : 0.f;
    for (int64_t r = 0; r < padded; ++r) {
        top[r] = -INFINITY;
        total[r] = 0.f;
        for (int64_t e = 0; e < DVP; ++e) o[r * DVP + e] = 0.f;
    }
    const int64_t end = CAUSAL ? KILN_MIN(LK, i0 + rows) : LK;
    for (int64_t n0 = 0; n0 < end; n0 += BN) {
        const int64_t keys = KILN_MIN(BN, end - n0), cols = KILN_ROUND(keys, NR);
        for (int64_t j = 0; j < cols; ++j)
            for (int64_t d = 0; d < D; ++d) kt[d * BN + j] = j < keys ? KILN_LOAD(K[(n0 + j) * K_RS + d]) : 0.f;
        for (int64_t j = 0; j < cols; ++j)
            for (int64_t e = 0; e < DVP; ++e) vb[j * DVP + e] = j < keys && e < DV ? KILN_LOAD(V[(n0 + j) * V_RS + e]) : 0.f;
        kiln_product(qb, D, kt, BN, D, s, BN, padded, cols, SCALE, 0);
        for (int64_t r = 0; r < padded; ++r)
            if (r < rows) kiln_softmax_row(ARGS, bh, i0 + r, n0, keys, cols, s + r * BN, top + r, total + r, o + r * DVP);
            else for (int64_t j = 0; j < cols; ++j) s[r * BN + j] = 0.f;
        kiln_product(s, BN, vb, DVP, cols, o, DVP, padded, DVP, 1.f, 1);
    }
    for (int64_t r = 0; r < rows; ++r) {
        float* row = o + r * DVP;
        for (int64_t e = 0; e < DV; ++e) row[e] = total[r] == 0.f ? 0.f : row[e] / total[r];
        kiln_epilogue_row(ARGS, bh, i0 + r, 0, DV, row);
    }
}

void kiln_kernel(PARAMS) {
    const int64_t blocks = (LQ + BM - 1) / BM, items = BATCH * blocks;
    const int threads = (double)BATCH * LQ * LK * (D + DV) > 65536.0 ? omp_get_max_threads() : 1;
#pragma omp parallel num_threads(threads)
    {
        float* qb = kiln_alloc(BM * D);
        float* kt = kiln_alloc(D * BN);
        float* vb = kiln_alloc(BN * DVP);
        float* s = kiln_alloc(BM * BN);
        float* o = kiln_alloc(BM * DVP);
        float* stats = kiln_alloc(2 * BM);
#pragma omp for schedule(dynamic, 1)
        for (int64_t u = 0; u < items; ++u) {
            const int64_t bh = u / blocks, i0 = u % blocks * BM;
            kiln_attend(ARGS, bh, i0, KILN_MIN(BM, LQ - i0), qb, kt, vb, s, o, stats, stats + BM);
        }
        free(stats);
        free(o);
        free(s);
        free(vb);
        free(kt);
        free(qb);
    }
}
"""

DTYPES = {dtypes.float32: ("float", "(x)"), dtypes.float16: ("uint16_t", "kiln_h2f(x)"),
          dtypes.bfloat16: ("uint16_t", "kiln_bf2f(x)")}
DEFAULT = {"BM": 64, "BN": 64}


def applies(task) -> bool:
    """Float32, float16 and bfloat16 attention whose q, k and v `match_attention` reads."""
    a = match_attention(task, "cpu")
    return a is not None and a.q.dtype == a.k.dtype == a.v.dtype and a.dtype in DTYPES


def render(task, BM: int, BN: int) -> CpuProgram:
    """The program `kiln_kernel(inputs..., output)` for `task`, BM queries and BN keys per block
    (BM a multiple of 8, BN of 64: whole micro-tiles on every vector width)."""
    a: Attention = match_attention(task, "cpu")
    if a is None or BM % 8 or BN % 64:
        raise ValueError(f"attention_cpu: does not apply to task '{task.name}' with BM={BM}, BN={BN} "
                         "(BM a multiple of 8, BN of 64)")
    storage, load = DTYPES[a.dtype]
    defines = {
        "PARAMS": a.params, "ARGS": a.args, "BATCH": a.batch_count, "LQ": a.Lq, "LK": a.Lk, "D": a.D, "DV": a.Dv,
        "BM": BM, "BN": BN, "SCALE": f"{a.scale!r}f", "CAUSAL": int(a.causal), "HAS_MASK": int(a.mask is not None),
        "MASK_BOOL": int(a.mask == "bool"), "KILN_T": storage, "KILN_LOAD(x)": load,
        "Q_PARAM": a.q.param, "K_PARAM": a.k.param, "V_PARAM": a.v.param,
        "Q_BASE": a.q.base(a.batch, a.group, "bh"), "K_BASE": a.k.base(a.batch, a.group, "bh"),
        "V_BASE": a.v.base(a.batch, a.group, "bh"),
        "Q_RS": f"(int64_t){a.q.row_stride}", "K_RS": f"(int64_t){a.k.row_stride}",
        "V_RS": f"(int64_t){a.v.row_stride}",
    }
    head = "".join(f"#define {name} {value}\n" for name, value in defines.items())
    return CpuProgram(C_PRELUDE + VECTORS + a.hooks + head + KERNEL, "kiln_kernel",
                      tuple(KernelArgs.args(len(task.inputs))))


def space(level: int) -> list[dict]:
    """One setting at every level (CPU templates are not timed)."""
    return [dict(DEFAULT)]


TEMPLATE = Template("attention_cpu", ("attention",), "cpu", render, priority=10, applies=applies, space=space,
                    reads_views=True, fixed_sizes_only=True)
