/* 3x3 convolutions of stride 1 by Winograd's F(2x2, 3x3) on micro.h's micro-kernel
   (kiln_ops_builtin.templates.conv_winograd_cpu tells the algorithm): the weight's transform U
   (kiln_wino_weights), the input's V per block of MR tiles (kiln_wino_input), the 16 products
   per panel of output channels, and the output's transform into the epilogue hook
   (kiln_wino_output). A block's tiles are MR consecutive ones of all the images' tiles, flat
   over (image, tile row, tile): a block may span tile rows and images (in segments, each
   within one tile row), so that no block computes tiles past a row's end (AVX2's 6-tile
   blocks on 14 x 14 pixels, 7 tiles a row, computed 12 a row).

   Each thread takes an equal share of the blocks, a chunk at a time: as many as CHUNK_BYTES of
   V hold (a macro of the program; 0: all of the thread's blocks), at least one. The chunk's V
   is made first, then the products panel by panel of output channels, so that a panel's U
   (16 x CIN x NR floats) is read once a chunk, not once a block.

   The problem is conv.h's (COUT the output channels; the planes are two per channel, even and
   odd columns: strides (1, 2)); PARAMS is the task's buffers. Needs micro.h, planes.h and the
   hooks (kiln_b_col, kiln_epilogue_row) ahead of it. */

enum {
    TILES_H = (OH + 1) / 2,
    TILES_W = (OW + 1) / 2,
    TILES = BATCH * TILES_H * TILES_W,      /* all the images' tiles */
    BLOCKS = (TILES + MR - 1) / MR,
    MRP = (MR + VW - 1) / VW * VW,          /* MR rounded up to whole vectors */
    COUT_PANELS = (COUT + NR - 1) / NR,
    VSTRIDE = CIN * MR + VW,                /* a position's A panel, and room for a vector's overrun */
};

/* U = G g G^T of every (input channel, output channel) as B panels per position p: panel q of
   output channels at (p * COUT_PANELS + q) * CIN * NR, k-major; vectorized over a panel's output
   channels. Returns their floats; writes them to dst unless NULL. */
static int64_t kiln_wino_weights(PARAMS, float* dst) {
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t q = 0; q < (dst ? COUT_PANELS : 0); ++q)
        for (int64_t c = 0; c < CIN; ++c) {
            float g[9 * NR] __attribute__((aligned(64)));      /* tap t of output channel q * NR + j at g[t * NR + j] */
            for (int64_t j = 0; j < NR; ++j) {
                if (q * NR + j < COUT) kiln_b_col(ARGS, 0, q * NR + j, c * 9, 9, g + j, NR);
                else for (int t = 0; t < 9; ++t) g[t * NR + j] = 0.f;
            }
#pragma GCC unroll 4
            for (int v = 0; v < NV; ++v) {
                kiln_vf t[4][3], u[4][4];
#pragma GCC unroll 3
                for (int s = 0; s < 3; ++s) {
                    const kiln_vf g0 = *(const kiln_vf*)(g + s * NR + v * VW), g1 = *(const kiln_vf*)(g + (3 + s) * NR + v * VW);
                    const kiln_vf g2 = *(const kiln_vf*)(g + (6 + s) * NR + v * VW);
                    t[0][s] = g0;
                    t[1][s] = (g0 + g1 + g2) * 0.5f;
                    t[2][s] = (g0 - g1 + g2) * 0.5f;
                    t[3][s] = g2;
                }
#pragma GCC unroll 4
                for (int i = 0; i < 4; ++i) {
                    u[i][0] = t[i][0];
                    u[i][1] = (t[i][0] + t[i][1] + t[i][2]) * 0.5f;
                    u[i][2] = (t[i][0] - t[i][1] + t[i][2]) * 0.5f;
                    u[i][3] = t[i][2];
                }
#pragma GCC unroll 16
                for (int p = 0; p < 16; ++p)
                    *(kiln_vf*)(dst + ((p * COUT_PANELS + q) * CIN + c) * NR + v * VW) = u[p / 4][p % 4];
            }
        }
    return 16 * COUT_PANELS * CIN * NR;
}

/* A block's tiles within one tile row: `len` tiles from tile tw of row th of image b, the
   block's tiles at .. at + len - 1 */
typedef struct { int64_t b, th, tw, at, len; } kiln_wino_segment;

/* the segments of the block of tiles t0 .. t0 + MR - 1 (those past the last tile in none);
   returns their number */
static inline int kiln_wino_segments(int64_t t0, kiln_wino_segment* seg) {
    int n = 0;
    for (int64_t at = 0; at < MR && t0 + at < TILES;) {
        const int64_t t = t0 + at, tw = t % TILES_W;
        seg[n] = (kiln_wino_segment){t / (TILES_H * TILES_W), t / TILES_W % TILES_H, tw, at, KILN_MIN(MR - at, TILES_W - tw)};
        at += seg[n++].len;
    }
    return n;
}

/* V = B^T d B of a block's tiles (segments seg[0 .. n - 1]), every input channel, vectorized
   over each segment's tiles: A panels per position at v + p * VSTRIDE, [c][MR]. A vector
   past a segment's end writes the rows of the next tiles or channel, which come later (the
   channels outer, the segments in order); the last channel's into the panel's VW spare floats. */
static void kiln_wino_input(const float* __restrict__ planes, const kiln_wino_segment* seg, int n,
                            float* __restrict__ v) {
    for (int64_t c = 0; c < CIN; ++c)
        for (int s = 0; s < n; ++s)
            for (int64_t i0 = 0; i0 < seg[s].len; i0 += VW) {
                const float* even = planes + seg[s].b * PLANE + c * 2 * HQ * WQ + 2 * seg[s].th * WQ + seg[s].tw + i0;
                const float* odd = even + HQ * WQ;
                kiln_vf t[4][4];
#pragma GCC unroll 4
                for (int j = 0; j < 4; ++j) {
                    const float* col = (j & 1 ? odd : even) + j / 2;
                    const kiln_vf d0 = *(const kiln_vfu*)col, d1 = *(const kiln_vfu*)(col + WQ);
                    const kiln_vf d2 = *(const kiln_vfu*)(col + 2 * WQ), d3 = *(const kiln_vfu*)(col + 3 * WQ);
                    t[0][j] = d0 - d2;
                    t[1][j] = d1 + d2;
                    t[2][j] = d2 - d1;
                    t[3][j] = d1 - d3;
                }
#pragma GCC unroll 4
                for (int i = 0; i < 4; ++i) {
                    float* at = v + 4 * i * VSTRIDE + c * MR + seg[s].at + i0;
                    *(kiln_vfu*)at = t[i][0] - t[i][2];
                    *(kiln_vfu*)(at + VSTRIDE) = t[i][1] + t[i][2];
                    *(kiln_vfu*)(at + 2 * VSTRIDE) = t[i][2] - t[i][1];
                    *(kiln_vfu*)(at + 3 * VSTRIDE) = t[i][1] - t[i][3];
                }
            }
}

/* Y = A^T M A for a block's MR tiles x NR output channels of panel q from the 16 products
   m[p][MR][NR], then, segment by segment (seg[0 .. n - 1]), each output channel's runs of
   pixels through the epilogue hook */
static void kiln_wino_output(PARAMS, const kiln_wino_segment* seg, int n, int64_t q, const float* __restrict__ m,
                             float* __restrict__ y, float* __restrict__ by_channel) {
    for (int64_t i = 0; i < MR; ++i)
#pragma GCC unroll 4
        for (int g = 0; g < NV; ++g) {
            kiln_vf u[2][4];
#pragma GCC unroll 4
            for (int j = 0; j < 4; ++j) {
                const float* at = m + j * MR * NR + i * NR + g * VW;
                const kiln_vf m0 = *(const kiln_vf*)at, m1 = *(const kiln_vf*)(at + 4 * MR * NR);
                const kiln_vf m2 = *(const kiln_vf*)(at + 8 * MR * NR), m3 = *(const kiln_vf*)(at + 12 * MR * NR);
                u[0][j] = m0 + m1 + m2;
                u[1][j] = m1 - m2 - m3;
            }
#pragma GCC unroll 2
            for (int dy = 0; dy < 2; ++dy) {
                *(kiln_vf*)(y + ((dy * 2) * MRP + i) * NR + g * VW) = u[dy][0] + u[dy][1] + u[dy][2];
                *(kiln_vf*)(y + ((dy * 2 + 1) * MRP + i) * NR + g * VW) = u[dy][1] - u[dy][2] - u[dy][3];
            }
        }
    /* each output (dy, dx) of the tiles, from (tile, channel) to (channel, tile) */
    for (int o = 0; o < 4; ++o)
        for (int64_t i0 = 0; i0 < MR; i0 += VW)
#pragma GCC unroll 4
            for (int g = 0; g < NV; ++g) {
                kiln_vf r[VW];
#pragma GCC unroll 16
                for (int i = 0; i < VW; ++i) r[i] = *(const kiln_vf*)(y + (o * MRP + i0 + i) * NR + g * VW);
                kiln_vtranspose(r);
#pragma GCC unroll 16
                for (int j = 0; j < VW; ++j) *(kiln_vf*)(by_channel + (o * NR + g * VW + j) * MRP + i0) = r[j];
            }
    const kiln_vi lo = KILN_ZIP_LO, hi = KILN_ZIP_HI;
    const int64_t n0 = q * NR, cols = KILN_MIN(NR, COUT - n0);
    for (int s = 0; s < n; ++s) {
        const int64_t th = seg[s].th, ow0 = 2 * seg[s].tw, valid = KILN_MIN(2 * seg[s].len, OW - ow0);
        for (int dy = 0; dy < 2 && 2 * th + dy < OH; ++dy)
            for (int64_t j = 0; j < cols; ++j) {
                float row[2 * MRP] __attribute__((aligned(64)));
                /* the segment's tiles from its first on (past them: the next channel's, never stored) */
                const float* left = by_channel + ((dy * 2) * NR + j) * MRP + seg[s].at;
                const float* right = left + NR * MRP;
                for (int64_t i0 = 0; i0 < seg[s].len; i0 += VW) {
                    const kiln_vf a = *(const kiln_vfu*)(left + i0), c = *(const kiln_vfu*)(right + i0);
                    *(kiln_vf*)(row + 2 * i0) = __builtin_shuffle(a, c, lo);
                    *(kiln_vf*)(row + 2 * i0 + VW) = __builtin_shuffle(a, c, hi);
                }
                kiln_epilogue_row(ARGS, seg[s].b, n0 + j, (2 * th + dy) * OW + ow0, valid, row);
            }
    }
}

static void kiln_wino(PARAMS, const float* __restrict__ bpre) {
    float* planes = kiln_alloc(BATCH * PLANE);
    const float* u = bpre;
    float* own = NULL;
    if (!u) {
        own = kiln_alloc(kiln_wino_weights(ARGS, NULL));
        kiln_wino_weights(ARGS, own);
        u = own;
    }
    const int threads = (double)BATCH * CIN * COUT * OH * OW > 65536.0 ? omp_get_max_threads() : 1;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for collapse(2) schedule(static)
        for (int64_t b = 0; b < BATCH; ++b)
            for (int64_t c = 0; c < CIN; ++c) kiln_fill(TASK_ARGS, b, c, planes + b * PLANE + c * 2 * HQ * WQ);
#pragma omp single
        for (int64_t b = 0; b < BATCH; ++b)
            for (int64_t e = CIN * 2 * HQ * WQ; e < PLANE; ++e) planes[b * PLANE + e] = 0.f;
        /* this thread's blocks a chunk at a time: their V made, then each panel of output channels
           (its U, read once a chunk) over the chunk's blocks */
        const int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
        const int64_t lo = BLOCKS * t / T, hi = BLOCKS * (t + 1) / T;
        const int64_t chunk = KILN_MIN(CHUNK_BYTES ? KILN_MAX(1, CHUNK_BYTES / (16 * VSTRIDE * 4)) : hi - lo, hi - lo);
        float* v = kiln_alloc(chunk * 16 * VSTRIDE);
        kiln_wino_segment (*seg)[MR] = malloc(chunk * sizeof *seg);
        int* n = malloc(chunk * sizeof *n);
        float* m = kiln_alloc(16 * MR * NR);
        float* y = kiln_alloc(4 * MRP * NR);
        float* by_channel = kiln_alloc(4 * NR * MRP + MRP);      /* a segment's last vector may read MRP past */
        /* rows past MR (transposed), and V's rows of tiles past the last (the last block's): never stored */
        for (int64_t e = 0; e < 4 * MRP * NR; ++e) y[e] = 0.f;
        for (int64_t e = 0; e < chunk * 16 * VSTRIDE; ++e) v[e] = 0.f;
        for (int64_t c0 = lo; c0 < hi; c0 += chunk) {
            const int64_t blocks = KILN_MIN(chunk, hi - c0);
            for (int64_t g = 0; g < blocks; ++g) {
                n[g] = kiln_wino_segments((c0 + g) * MR, seg[g]);
                kiln_wino_input(planes, seg[g], n[g], v + g * 16 * VSTRIDE);
            }
            for (int64_t q = 0; q < COUT_PANELS; ++q)
                for (int64_t g = 0; g < blocks; ++g) {
                    for (int p = 0; p < 16; ++p)
                        kiln_micro(CIN, v + (g * 16 + p) * VSTRIDE, u + (p * COUT_PANELS + q) * CIN * NR, NULL, 0,
                                   m + p * MR * NR, NR, NULL, 0);
                    kiln_wino_output(ARGS, seg[g], n[g], q, m, y, by_channel);
                }
        }
        free(n);
        free(seg);
        free(by_channel);
        free(y);
        free(m);
        free(v);
    }
    free(own);
    free(planes);
}

static int64_t kiln_wino_prepare(PARAMS, const float* __restrict__ bpre, float* dst) {
    (void)bpre;
    return kiln_wino_weights(ARGS, dst);
}
