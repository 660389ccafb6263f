/* The blocking and threads of the CPU GEMM templates (kiln_ops_builtin.templates.gemm_cpu tells
   the algorithm): B's packing, the blocks of one thread, the threads' split (kiln_gemm), and B's
   panels laid out once where B is a constant (kiln_pack_panels).

   Compile-time knobs, macros of the rendered program: KC and NC (the blocks' depth and width;
   NC whole panels), B_BY_K (1: B is packed from runs along k, kiln_b_col; 0: along n,
   kiln_b_row), B_GROUPS (the different Bs of the batches: batch b reads the (b % B_GROUPS)-th),
   A_DIRECT (micro.h), ROWS_OUTER (1: a block's A panels outer, each sweeping all of the block's
   B panels, so that C's rows are written MR at a time in long runs, B's block staying in L2;
   0 or undefined: B panels outer, a B panel staying in L1 while A's stream from L2, which
   writes a short piece of every row of the block per B panel), B_PREFETCH (1: with B panels
   outer and B laid out once, the panel read next (the K block's rows of the next panel, or of
   the next K block's first) prefetched into L2 while the current one computes, each A panel's
   micro-kernel a share of its lines: laid-out panels come from L3 or memory, where the hardware
   prefetcher alone leaves the micro-kernel waiting; BERT's and a Llama's linear layers ran
   about 15-20% faster). The problem: BATCH, M, N and K, written in the kernel's size
   parameters where they are symbolic. PARAMS is the parameter list of the hooks and of these
   functions (ARGS passes it on): the task's buffers, `bpre` (B's panels laid out once, or NULL
   to pack them here), what the template adds, and the sizes.

   Needs micro.h, kiln_pack_a, the store of finished tiles (gemm_hooks.h or the template's own),
   B's hooks, and kiln_a_rows where A_DIRECT (A's rows from k0 on, a whole number of micro.h's
   A_TAPS; KC then a multiple of them), ahead of it. The store: STAGED_TILES 0 and
   kiln_store_tile (PARAMS, b, m0, n0, rows, cols, tile), a tile at a time; or STAGED_TILES 1
   (B panels outer only), kiln_stage_tile (r, tile, stage) into a stage of STAGE_FLOATS floats
   (r: the tile's first row less the block's), then kiln_store_stage (PARAMS, b, ic, mc, n0,
   cols, stage) once a B panel's tiles over A's block of rows ic .. ic + mc - 1 are all staged. */

#if STAGED_TILES && ROWS_OUTER
#error "staged tiles need B's panels outer"
#endif

/* B's columns n0 .. n0 + cols - 1 (zeros past them) for k0 .. k0 + kc - 1, as one k-major NR-wide panel */
static void kiln_pack_b(PARAMS, int64_t b, int64_t n0, int64_t cols, int64_t k0, int64_t kc,
                        float* __restrict__ dst) {
#if B_BY_K
    /* runs of `ch` k of VW columns copied contiguous, then transposed VW x VW in registers;
       the k that no run covers one by one */
    int64_t k = 0;
    for (int64_t ch = 64; ch >= VW; ch /= 4)
        for (; k + ch <= kc; k += ch)
            for (int64_t g = 0; g < NV; ++g) {
                float run[VW * 64] __attribute__((aligned(64)));
                for (int64_t j = 0; j < VW; ++j) {
                    if (g * VW + j < cols) kiln_b_col(ARGS, b, n0 + g * VW + j, k0 + k, ch, run + j * ch, 1);
                    else for (int64_t e = 0; e < ch; ++e) run[j * ch + e] = 0.f;
                }
                for (int64_t s = 0; s < ch; s += VW) {
                    kiln_vf r[VW];
                    for (int64_t j = 0; j < VW; ++j) r[j] = *(const kiln_vf*)(run + j * ch + s);
                    kiln_vtranspose(r);
                    for (int64_t i = 0; i < VW; ++i) *(kiln_vf*)(dst + (k + s + i) * NR + g * VW) = r[i];
                }
            }
    for (int64_t j = 0; j < cols; ++j) kiln_b_col(ARGS, b, n0 + j, k0 + k, kc - k, dst + k * NR + j, NR);
    for (int64_t e = k; e < kc; ++e)
        for (int64_t j = cols; j < NR; ++j) dst[e * NR + j] = 0.f;
#else
    for (int64_t k = 0; k < kc; ++k) {
        kiln_b_row(ARGS, b, k0 + k, n0, cols, dst + k * NR);
        for (int64_t j = cols; j < NR; ++j) dst[k * NR + j] = 0.f;
    }
#endif
}

/* B's columns n0 .. n0 + cols - 1 (zeros past them, up to whole panels) for k0 .. k0 + kc - 1,
   as k-major NR-wide panels, panel p at dst + p * NR * kc. Along n (not B_BY_K), a row of all
   the columns is read at once into `row` (long runs that the hardware prefetches; panel by
   panel, each row's 32 columns would be a short run of another page) and dealt out to the
   panels. */
static void kiln_pack_b_block(PARAMS, int64_t b, int64_t n0, int64_t cols, int64_t k0, int64_t kc,
                              float* __restrict__ dst) {
    const int64_t panels = KILN_PANELS(cols, NR);
#if B_BY_K
    for (int64_t p = 0; p < panels; ++p)
        kiln_pack_b(ARGS, b, n0 + p * NR, KILN_MIN(NR, cols - p * NR), k0, kc, dst + p * NR * kc);
#else
    float row[KILN_PANELS(NC, NR) * NR] __attribute__((aligned(64)));
    for (int64_t j = cols; j < panels * NR; ++j) row[j] = 0.f;
    for (int64_t k = 0; k < kc; ++k) {
        kiln_b_row(ARGS, b, k0 + k, n0, cols, row);
        for (int64_t p = 0; p < panels; ++p)
#pragma GCC unroll 4
            for (int j = 0; j < NV; ++j) *(kiln_vf*)(dst + (p * kc + k) * NR + j * VW) = *(const kiln_vf*)(row + p * NR + j * VW);
    }
#endif
}

/* whether the next B panel is prefetched (B_PREFETCH; B panels outer only) */
#if B_PREFETCH && !ROWS_OUTER
#define KILN_B_AHEAD 1
#else
#define KILN_B_AHEAD 0
#endif

/* the tiles of panels [m_lo, m_hi) x [n_lo, n_hi) of batches [b_lo, b_hi), on one thread with
   its own packing buffers; the batches inside each block of B, so that a B laid out once and
   shared by the batches (a convolution's weight, the images its batches) is read into the
   caches once per block, not once per batch; ws (where K is cut into blocks) holds M x N floats
   for each of the batches */
static void kiln_block(PARAMS, int64_t b_lo, int64_t b_hi, int64_t m_lo, int64_t m_hi, int64_t n_lo, int64_t n_hi,
                       float* __restrict__ apack, float* __restrict__ bpack, float* __restrict__ ws_all) {
#if STAGED_TILES
    float stage[STAGE_FLOATS] __attribute__((aligned(64)));
#endif
    for (int64_t jc = n_lo; jc < n_hi; jc += NC)
    for (int64_t pc = 0; pc < K; pc += KC)
    for (int64_t b = b_lo; b < b_hi; ++b) {
        const int64_t nc = KILN_MIN(NC, n_hi - jc), kc = KILN_MIN(KC, K - pc);
        const int64_t npanels = KILN_PANELS(nc, NR);
        const int first = pc == 0, last = pc + kc >= K;
        float* const ws = ws_all ? ws_all + (b - b_lo) * M * N : NULL;
        if (!bpre) kiln_pack_b_block(ARGS, b, jc, nc, pc, kc, bpack);
        /* B's panels: packed here (panel p at p * NR * kc) or laid out once (jc is whole panels) */
        const float* const bpanels = bpre ? bpre + b % B_GROUPS * KILN_PANELS(N, NR) * NR * K + jc * K + pc * NR : bpack;
        const int64_t bstride = bpre ? NR * K : NR * kc;
        for (int64_t ic = m_lo; ic < m_hi; ic += MCB) {
            const int64_t mc = KILN_MIN(MCB, m_hi - ic), mpanels = KILN_PANELS(mc, MR);
            for (int64_t p = 0; p < mpanels && !A_DIRECT; ++p)
                kiln_pack_a(ARGS, b, ic + p * MR, KILN_MIN(MR, M - ic - p * MR), pc, kc, apack + p * MR * kc);
#if ROWS_OUTER
            for (int64_t ip = 0; ip < mpanels; ++ip) {
                for (int64_t jp = 0; jp < npanels; ++jp) {
#else
            for (int64_t jp = 0; jp < npanels; ++jp) {
                for (int64_t ip = 0; ip < mpanels; ++ip) {
#endif
                    float tile[MR * NR] __attribute__((aligned(64)));
                    const int64_t m0 = ic + ip * MR, n0 = jc + jp * NR;
                    /* this A panel's share of the cache lines of the B panel read next (B_PREFETCH): the
                       block's next panel; after its last, its first again for the next A block (or the
                       next batch's, the same B), else the next K block's first (none after the last K block) */
                    const int more_a = ic + MCB < m_hi || (b + 1 < b_hi && B_GROUPS == 1);
                    const float* const next = jp + 1 < npanels ? bpanels + (jp + 1) * bstride : more_a ? bpanels : bpanels + kc * NR;
                    const int64_t next_rows = jp + 1 < npanels || more_a ? kc : KILN_MIN(KC, K - pc - kc);
                    const int64_t ahead_lines = KILN_B_AHEAD && bpre ? KILN_PANELS(next_rows * NR, 16) : 0;
                    const int64_t share = KILN_PANELS(ahead_lines, mpanels);
                    const int64_t lines = KILN_MIN(share, ahead_lines - KILN_MIN(ahead_lines, ip * share));
                    const float* const ahead = next + ip * share * 16;
                    const int64_t rows = KILN_MIN(MR, M - m0), cols = KILN_MIN(NR, N - n0);
                    const int full = rows == MR && cols == NR;
                    float* w = ws + (full ? m0 * N + n0 : 0);
                    if (!first && !full)
                        for (int64_t i = 0; i < rows; ++i)
                            for (int64_t j = 0; j < cols; ++j) tile[i * NR + j] = ws[(m0 + i) * N + n0 + j];
                    const float* cin = first ? NULL : full ? w : tile;
                    const int to_ws = full && !last;
                    float* const out = to_ws ? w : tile;
                    const int64_t ldin = full ? N : NR, ldout = to_ws ? N : NR;
#if A_DIRECT
                    kiln_micro(kc, kiln_a_rows(ARGS, b, m0, pc), bpanels + jp * bstride, cin, ldin, out, ldout, ahead, lines);
#else
                    const float* const apanel = apack + ip * MR * kc;
                    if (rows < MR && rows <= KILN_SHORT_ROWS)    /* not full: cin (where not NULL) and out are the tile */
                        kiln_micro_short(rows, kc, apanel, bpanels + jp * bstride, cin, NR, tile, NR, ahead, lines);
                    else
                        kiln_micro(kc, apanel, bpanels + jp * bstride, cin, ldin, out, ldout, ahead, lines);
#endif
                    if (last)
#if STAGED_TILES
                        kiln_stage_tile(m0 - ic, tile, stage);
#else
                        kiln_store_tile(ARGS, b, m0, n0, rows, cols, tile);
#endif
                    else if (!full)
                        for (int64_t i = 0; i < rows; ++i)
                            for (int64_t j = 0; j < cols; ++j) ws[(m0 + i) * N + n0 + j] = tile[i * NR + j];
                }
#if STAGED_TILES
                if (last) kiln_store_stage(ARGS, b, ic, mc, jc + jp * NR, KILN_MIN(NR, N - jc - jp * NR), stage);
#endif
            }
        }
    }
}

/* Threads split the batches where each batch runs alone (see below) and its A is larger than
   B (BATCH x M > N: a convolution's large planes against its weight, which every thread then
   reads whole), so that each thread reads only its own images' planes; else N (or M, where N
   has too few panels) in whole panels. They never wait on each other: each packs its own
   operand blocks (B's only where bpre, B laid out once, is NULL).
   Where B is laid out once and larger than a batch's A (M < N: a convolution's late layers,
   7 x 7 or 14 x 14 pixels against hundreds of channels), the batches go inside each block of B
   (kiln_block), so that B is read into the caches once, not once per image; otherwise one batch
   at a time, so that a batch's A (large planes) stays in the caches across B's blocks. */
static void kiln_gemm(PARAMS) {
    const int64_t kcap = KILN_MIN(KC, K);
    const int64_t together = bpre && M < N ? BATCH : 1;     /* batches in one kiln_block */
    float* ws = K > KC ? (float*)malloc((size_t)together * M * N * 4) : NULL;
    const int threads = (double)BATCH * M * N * K > 65536.0 ? omp_get_max_threads() : 1;
#pragma omp parallel num_threads(threads)
    {
        const int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
        const int split_b = together == 1 && T > 1 && (BATCH % T == 0 || BATCH >= 4 * T) && BATCH * M > N;
        const int split_n = !split_b && (KILN_PANELS(N, NR) >= 4 * T || N >= M);
        const int64_t panels = split_n ? KILN_PANELS(N, NR) : KILN_PANELS(M, MR);
        const int64_t width = split_n ? NR : MR, extent = split_n ? N : M;
        const int64_t lo = split_b ? 0 : KILN_MIN(panels * t / T * width, extent);
        const int64_t hi = split_b ? M : KILN_MIN(panels * (t + 1) / T * width, extent);
        const int64_t b_lo = split_b ? BATCH * t / T : 0, b_end = split_b ? BATCH * (t + 1) / T : BATCH;
        float* bpack = bpre ? NULL : kiln_alloc(KILN_PANELS(KILN_MIN(NC, N), NR) * NR * kcap);
        float* apack = kiln_alloc(KILN_PANELS(KILN_MIN(MCB, M), MR) * MR * kcap);
        /* each thread its own workspace where K is cut into blocks and the batches split */
        float* own = split_b && ws ? (float*)malloc((size_t)M * N * 4) : NULL;
        if (lo < hi)
            for (int64_t b = b_lo; b < b_end; b += together) {
                const int64_t b_hi = KILN_MIN(b + together, b_end);
                if (split_n) kiln_block(ARGS, b, b_hi, 0, M, lo, hi, apack, bpack, ws);
                else kiln_block(ARGS, b, b_hi, lo, hi, 0, N, apack, bpack, own ? own : ws);
            }
        free(own);
        free(apack);
        free(bpack);
    }
    free(ws);
}

/* B's panels for every n and k, laid out once where B is a constant (the kernels' bpre): as
   kiln_pack_b packs them, K deep, panel p at p * NR * K, for each of the B_GROUPS different Bs
   (batch b reads the (b % B_GROUPS)-th: a grouped convolution's groups). Returns their floats;
   writes them to dst unless it is NULL. Panels of fewer than KILN_PACK_PARALLEL_FLOATS floats
   are laid out by one thread: a copy of a few megabytes takes less than waking the others (a
   graph-cache hit lays out every weight of a model, each at once). */
#define KILN_PACK_PARALLEL_FLOATS (1 << 20)
static int64_t kiln_pack_panels(PARAMS, float* dst) {
    const int64_t panels = KILN_PANELS(N, NR);
#pragma omp parallel for collapse(2) schedule(static) if (B_GROUPS * panels * NR * K >= KILN_PACK_PARALLEL_FLOATS)
    for (int64_t b = 0; b < (dst ? B_GROUPS : 0); ++b)
        for (int64_t p = 0; p < panels; ++p)
            kiln_pack_b(ARGS, b, p * NR, KILN_MIN(NR, N - p * NR), 0, K, dst + (b * panels + p) * NR * K);
    return B_GROUPS * panels * NR * K;
}
