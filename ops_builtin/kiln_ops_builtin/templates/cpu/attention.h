/* Fused attention, softmax(q k^T * scale + mask) v, one pass over the keys per block of
   queries with the online softmax (kiln_ops_builtin.templates.attention_cpu tells the algorithm).

   Compile-time knobs, macros of the rendered program: BM and BN (queries and keys per block).
   The problem: BATCH (flat batch and heads), LQ, LK, D, DV, SCALE, CAUSAL, HAS_MASK (the hook
   kiln_mask, a bool keeping where MASK_BOOL, else a float added), ELEM (the operands' storage)
   and ELEM_FLOAT (its conversion to float), the row strides Q_RS, K_RS, V_RS. PARAMS is the
   kernel's parameter list (ARGS passes it on). Needs simd.h, common.h, the hooks kiln_mask and
   kiln_epilogue_row, and kiln_q, kiln_k, kiln_v (an operand of flat batch bh) ahead of it. */

enum {
    MR = VW == 16 ? 8 : 6,          /* queries per micro-tile: 12 accumulators or more, which hide the FMA's latency */
    NR = 2 * VW,                    /* keys (scores) or value columns (P V) per micro-tile */
    DVP = (DV + NR - 1) / NR * NR,  /* value columns, whole micro-tiles */
    BMP = (BM + MR - 1) / MR * MR,  /* a block's queries, whole micro-tiles */
};

static inline float kiln_f32(float x) { return x; }     /* ELEM_FLOAT of float32 operands */

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
                kiln_vf b0 = *(const kiln_vf*)(b + k * ldb + j), b1 = *(const kiln_vf*)(b + k * ldb + j + VW);
                /* in registers: GCC otherwise reads them again as an operand of every multiply-add,
                   and the loads, not the multiply-adds, bound the loop */
                __asm__("" : "+x"(b0), "+x"(b1));
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
        if (MASK_BOOL) {
            if (!kiln_mask(ARGS, bh, i, n0 + j)) s[j] = -INFINITY;
        } else {
            s[j] += kiln_mask(ARGS, bh, i, n0 + j);
        }
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
    const ELEM* Q = kiln_q(ARGS, bh) + i0 * Q_RS;
    const ELEM* K = kiln_k(ARGS, bh);
    const ELEM* V = kiln_v(ARGS, bh);
    const int64_t padded = KILN_PANELS(rows, MR) * MR;
    for (int64_t r = 0; r < padded; ++r)
        for (int64_t d = 0; d < D; ++d) qb[r * D + d] = r < rows ? ELEM_FLOAT(Q[r * Q_RS + d]) : 0.f;
    for (int64_t r = 0; r < padded; ++r) {
        top[r] = -INFINITY;
        total[r] = 0.f;
        for (int64_t e = 0; e < DVP; ++e) o[r * DVP + e] = 0.f;
    }
    const int64_t end = CAUSAL ? KILN_MIN(LK, i0 + rows) : LK;
    for (int64_t n0 = 0; n0 < end; n0 += BN) {
        const int64_t keys = KILN_MIN(BN, end - n0), cols = KILN_PANELS(keys, NR) * NR;
        for (int64_t j = 0; j < cols; ++j)
            for (int64_t d = 0; d < D; ++d) kt[d * BN + j] = j < keys ? ELEM_FLOAT(K[(n0 + j) * K_RS + d]) : 0.f;
        for (int64_t j = 0; j < cols; ++j)
            for (int64_t e = 0; e < DVP; ++e) vb[j * DVP + e] = j < keys && e < DV ? ELEM_FLOAT(V[(n0 + j) * V_RS + e]) : 0.f;
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
        float* qb = kiln_alloc(BMP * D);
        float* kt = kiln_alloc(D * BN);
        float* vb = kiln_alloc(BN * DVP);
        float* s = kiln_alloc(BMP * BN);
        float* o = kiln_alloc(BMP * DVP);
        float* stats = kiln_alloc(2 * BMP);
#pragma omp for schedule(dynamic, 1)
        for (int64_t u = 0; u < items; ++u) {
            const int64_t bh = u / blocks, i0 = u % blocks * BM;
            kiln_attend(ARGS, bh, i0, KILN_MIN(BM, LQ - i0), qb, kt, vb, s, o, stats, stats + BMP);
        }
        free(stats);
        free(o);
        free(s);
        free(vb);
        free(kt);
        free(qb);
    }
}
