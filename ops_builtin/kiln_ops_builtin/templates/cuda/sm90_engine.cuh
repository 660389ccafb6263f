// The Hopper contraction engine of kiln_ops_builtin.templates.sm90_engine (its docstring tells the
// algorithm): kiln::sm90::run<P> is the body of a persistent, warp-specialized wgmma kernel whose
// producer warpgroup fills a STAGES-deep ring of 128-byte-deep slices of K of A and B (the
// program's load and Gather), and whose CW consumer warpgroups multiply them and hand the tile
// to the epilogue hooks through split_k's stores, the vector hook (VEC) or TMA stores (TMA_STORE).
// A program's rendered kernel calls it with its arguments and its tensor maps.
//
// Needs, ahead of it, the PTX wrappers MBARRIER, TMA, DSMEM and CLUSTER, tma_batch.cuh, the wgmma
// product WGMMA(acc, da, db) (m64n{BN}k16, or m64n{BN}k8 for TF32), split_k's stores and the
// macros M, N, K, KT_SPLIT, BATCH, PARAMS, ARGS, KERNEL_ARGS; and, ahead of a call, the program P
// (sm90_engine.py renders it):
//   BM, BN, BK, KB, CW, MI, PP, STAGES, GROUP, FETCH, CLUSTER, EPI_LD   tile, ring, consumers,
//                  rasterization, epilogue fetch depth, cluster size, staging block row stride
//   TRANS_A, TRANS_B       1 where an operand's stage is MN-major (wgmma's transpose bit)
//   SWIZZLE_ATOM, MN_LBO   the byte stride of 8 rows of a stage, of 64-element MN chunks (MN-major)
//   PRODUCERS, GATHERED, FULL_ARRIVALS, TMA_BYTES, PRODUCER_REGS, CONSUMER_REGS
//                          the producer threads, whether they gather by cp.async, a full
//                          barrier's arrivals and transaction bytes, the warpgroups' registers
//   NSRC, SRC_BYTES        epilogue source tiles staged by TMA and the bytes of one buffer of them
//   FETCHES, VEC, TMA_STORE, PACKED   whether the epilogue fetches what it reads ahead of its stores,
//                          the vector hook's width (0: pairs), whether outputs are packed to 16 bits
//                          in registers and stored by TMA (TMA_STORE) or else by 16-byte lane stores
//                          (PACKED)
//   Maps                   the kernel's tensor maps (pointers to its __grid_constant__ parameters)
//   Gather(tid, m0, KERNEL_ARGS)  a producer thread's state for the tile at row m0, its call
//                          (as, k0, bar, KERNEL_ARGS) filling slot `as` at k0 and arriving on bar
//                          (then or later), and finish(), after the tile's last call, by which
//                          it has arrived on every slot it filled (NoGather where thread 0
//                          loads by TMA alone)
//   load(as, bs, bar, k0, m0, n0, bz, rank, maps, KERNEL_ARGS)   thread 0's TMA copies of a slot
//                          (load_operand's, one per operand that TMA loads)
//   load_sources(tiles, bar, m0, n0, maps)                thread 0's copies of the source tiles
//   fetch(KERNEL_ARGS, tiles, b, m, n, f, at)      what the stores will read of a row pair, into f
//   store_v(KERNEL_ARGS, tiles, b, m, n, v, at)    VEC outputs through the vector hook
//   pack2(KERNEL_ARGS, b, m, n, v0, v1)   with TMA_STORE or PACKED: the packing of an output pair
//   O_BATCHED              with TMA_STORE: whether the output map has a batch dimension
//   out_at(KERNEL_ARGS, b, m, n)   with PACKED: the address of output (b, m, n)
// (`tiles`: the buffer of staged source tiles; `at`: the element's place in a tile).

extern __shared__ unsigned char kiln_smem_raw[];   // the ring, the source tiles, the barriers, the staging blocks

namespace kiln::sm90 {

// Where thread 0 loads every operand by TMA: no producer thread gathers.
struct NoGather {
    __device__ __forceinline__ NoGather(int, int64_t, PARAMS) {}
    __device__ __forceinline__ void operator()(uint16_t*, int, uint64_t*, PARAMS) {}
    __device__ __forceinline__ void finish() {}
};

// One TMA box copy at coordinates (c0, c1, batch..) into `dst`, completing on `bar`; with CTAS
// (a mask of a cluster's CTAs) multicast into each of them.
template <int CTAS, class... Batch>
static __device__ __forceinline__ void tma_box(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1,
                                               Batch... batch) {
    if constexpr (CTAS == 0)
        kiln_tma(dst, map, bar, c0, c1, batch...);
    else
        kiln_tma_multicast(dst, map, bar, CTAS, c0, c1, batch...);
}

// Thread 0's TMA copies of an operand's tile at row x0 (of M or N) and k0 into its stage `dst`,
// completing on `bar`: K-major (TRANS = 0), one box of the k-slice and PART rows; MN-major
// (TRANS = 1), PART boxes of 64 rows (MN_LBO bytes apart). In a cluster of PARTS CTAs sharing the
// tile, CTA `rank` copies part `rank` into every CTA's stage by multicast. `batch`: the map's
// batch dimensions, at flat batch bz.
template <int TRANS, int PART, int PARTS, int RANK>
static __device__ __forceinline__ void load_operand(uint16_t* dst, const CUtensorMap* map, uint64_t* bar, int k0,
                                                    int x0, int rank, const kiln::tma::Batch<RANK>& batch, int64_t bz) {
    constexpr int CTAS = PARTS == 1 ? 0 : (1 << PARTS) - 1, ROW = 64;   // ROW: 16-bit units of a stage's row
    kiln::tma::with_coordinates(batch, bz, [&](auto... c) {
        if constexpr (TRANS) {
            const int first = PARTS == 1 ? 0 : rank * PART;
            for (int j = first; j < first + PART; ++j)
                tma_box<CTAS>(dst + j * 64 * ROW, map, bar, x0 + j * 64, k0, c...);
        } else if constexpr (PARTS == 1) {
            tma_box<CTAS>(dst, map, bar, k0, x0, c...);
        } else {
            tma_box<CTAS>(dst + rank * PART * ROW, map, bar, k0, x0 + rank * PART, c...);
        }
    });
}

// The TMA store of a warp's 16 x 64 output block `tile` at column x, row y (of flat batch bz where
// the output map has a batch dimension, O_BATCHED).
template <class P>
static __device__ __forceinline__ void store_tile(const CUtensorMap* map, const void* tile, int x, int y, int bz) {
    if constexpr (P::O_BATCHED)
        kiln_tma_store_3d(map, tile, x, y, bz);
    else
        kiln_tma_store_2d(map, tile, x, y);
}

// A work unit: split ks of the tile at (m0, n0) of flat batch bz, k-tiles kt0 .. kt1 - 1.
struct Unit {
    int ks, bz;
    int64_t m0, n0;
    int kt0, kt1;
};

// {x / d, x % d} for a d in [1, D] that every thread of the CTA shares: one uniform branch per
// divisor, each a division by a constant (a run-time division would sit on the path to each
// unit's first copy).
template <int D>
static __device__ __forceinline__ int2 divmod_upto(int x, int d) {
    if constexpr (D > 1)
        if (d != D) return divmod_upto<D - 1>(x, d);
    return make_int2(x / D, x % D);
}

// Unit `unit` of CTA `rank` of its cluster: GROUP tile rows are walked column by column, each
// work unit being CLUSTER vertically adjacent tiles (a split: kt_split k-tiles).
template <class P>
static __device__ __forceinline__ Unit unit_at(int unit, int tiles_m, int tiles_n, int per_batch, int batches,
                                               int k_tiles, int kt_split, int rank) {
    const int ks = unit % kiln_split_k_program::SPLIT, tile = unit / kiln_split_k_program::SPLIT;
    const int bz = batches == 1 ? 0 : tile / per_batch, r = batches == 1 ? tile : tile % per_batch;
    const int band = P::GROUP * tiles_n, first_m = r / band * P::GROUP, rows = min(tiles_m - first_m, P::GROUP);
    const int2 in_band = divmod_upto<P::GROUP>(r % band, rows);
    const int tm = (first_m + in_band.y) * P::CLUSTER + rank, tn = in_band.x;
    const int64_t m0 = (int64_t)tm * P::BM, n0 = (int64_t)tn * P::BN;
    const int kt0 = ks * kt_split, kt1 = min(k_tiles, kt0 + kt_split);
    return {ks, bz, m0, n0, kt0, kt1};
}

// The descriptor of k-slice kk (16 deep) of stage s, K-major or (TRANS) MN-major.
template <class P, int TRANS>
static __device__ __forceinline__ uint64_t stage_desc(const uint16_t* s, int kk) {
    if constexpr (TRANS)
        return kiln_gdesc((s) + (kk) * 16 * 64, P::MN_LBO, P::SWIZZLE_ATOM);
    else
        return (kiln_gdesc((s), 16, P::SWIZZLE_ATOM) + 2 * (kk));
}

// A consumer's release of ring slot `bar`: one arrival per thread, or in a cluster one per warp on
// the slot's barrier in each CTA (both CTAs' producers fill it).
template <class P>
static __device__ __forceinline__ void release(uint64_t* bar, int lane, int rank) {
    if constexpr (P::CLUSTER == 1) {
        kiln_bar_arrive(bar);
    } else {
        if (lane == 0) { kiln_bar_arrive(bar); kiln_bar_arrive_cta(bar, rank ^ 1); }
    }
}

// A warp's 16 x 32 block q of slab accumulators `acc` into its staging block (rows of EPI_LD floats).
template <class P>
static __device__ __forceinline__ void stage_block(float* staged, const float* acc, int q, int lane) {
    for (int jj = 0; jj < 4; ++jj) for (int h = 0; h < 2; ++h) *(float2*)&staged[(lane / 4 + h * 8) * P::EPI_LD + jj * 8 + (lane % 4) * 2] = make_float2(acc[(q * 4 + jj) * 4 + h * 2], acc[(q * 4 + jj) * 4 + h * 2 + 1]); __syncwarp();
}

// A warp's 16 x 64 block of outputs at row m0, column n0, from the accumulators `v` of its first
// column pair (16 x 8 column group jj at v[jj * 4]), packed by the hook into the 128-byte-swizzled
// rows of `packed` (row r's 16-byte chunk j at r * 128 + (j ^ r % 8) * 16). Places past M and N are
// packed from the last row and column pair in range instead (their stores are clipped), so that
// every call reads in bounds and the calls of rows r and r + 8 read the same columns.
template <class P>
static __device__ __forceinline__ void pack_block(PARAMS, unsigned char* packed, const float* v, int bz, int64_t m0,
                                                  int64_t n0, int lane) {
#pragma unroll
    for (int jj = 0; jj < 8; ++jj)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = lane / 4 + h * 8, col = jj * 8 + (lane % 4) * 2;
            const int64_t m = min(m0 + row, (int64_t)(M) - 1), n = min(n0 + col, (int64_t)(N) - 2);
            *(uint32_t*)(packed + row * 128 + ((jj ^ (row & 7)) * 16) + (lane % 4) * 4) =
                P::pack2(KERNEL_ARGS, bz, m, n, v[jj * 4 + h * 2], v[jj * 4 + h * 2 + 1]);
        }
}

// A warp's store of the block pack_block packed at row m0, column n0: a 128-byte row per 8 lanes,
// 16 bytes a lane (the pairs before N where a row's last 8 columns cross it).
template <class P>
static __device__ __forceinline__ void store_packed(PARAMS, const unsigned char* packed, int bz, int64_t m0, int64_t n0,
                                                    int lane) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
        const int row = r * 4 + lane / 8, chunk = lane % 8;
        const uint4 v = *(const uint4*)(packed + row * 128 + ((chunk ^ (row & 7)) * 16));
        const int64_t m = m0 + row, n = n0 + chunk * 8;
        if (m < M && n < N) {
            void* out = P::out_at(KERNEL_ARGS, bz, m, n);
            if (n + 8 <= N) {
                asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};\n" :: "l"(out), "r"(v.x), "r"(v.y), "r"(v.z),
                             "r"(v.w) : "memory");
            } else {
                const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
                for (int k = 0; k < 4; ++k)
                    if (n + 2 * k < N) ((uint32_t*)out)[k] = words[k];
            }
        }
    }
}

// The accumulators pinned here: no instruction that reads or writes them moves across. A wgmma's
// asm names them at its issue while the tensor cores use them until the wait; an instruction that
// touches them in between makes ptxas serialize every wgmma of the kernel (its warning C7514).
template <int SLABS, int PER_SLAB>
static __device__ __forceinline__ void fence_accumulators(float (&acc)[SLABS][PER_SLAB]) {
#pragma unroll
    for (int i = 0; i < SLABS; ++i)
#pragma unroll
        for (int j = 0; j < PER_SLAB; ++j) asm volatile("" : "+f"(acc[i][j]) :: "memory");
}

template <class P>
static __device__ __forceinline__ void run(PARAMS, const typename P::Maps& maps) {
    constexpr int BM = P::BM, BN = P::BN, BK = P::BK, KB = P::KB, EPI_LD = P::EPI_LD, CW = P::CW, MI = P::MI;
    constexpr int PP = P::PP, STAGES = P::STAGES, SRC_BYTES = P::SRC_BYTES, FETCH = P::FETCH, VEC = P::VEC;
    constexpr int CLUSTER = P::CLUSTER;
    constexpr int EMPTY_ARRIVALS = CLUSTER == 1 ? 128 * (PP ? 1 : CW) : 128 * (PP ? 1 : CW) / 32 * CLUSTER;
    uint16_t* As = (uint16_t*)(((uint64_t)kiln_smem_raw + 1023) & ~(uint64_t)1023);
    uint16_t* Bs = As + STAGES * BM * BK;
    unsigned char* srcs = (unsigned char*)(Bs + STAGES * BN * BK);   // two buffers of the epilogue's source tiles
    uint64_t* full = (uint64_t*)(srcs + 2 * SRC_BYTES);
    uint64_t* empty = full + STAGES;
    uint64_t* src_full = empty + STAGES;
    uint64_t* src_empty = src_full + 2;
    float* epi = (float*)(src_empty + 2);      // CW * 4 warps x 16 x EPI_LD staged accumulators
    const int tid = threadIdx.x, wg = tid / 128;
    if (tid == 0) {
        for (int s = 0; s < STAGES; ++s) {
            kiln_bar_init(&full[s], P::FULL_ARRIVALS);
            kiln_bar_init(&empty[s], EMPTY_ARRIVALS);
        }
        for (int s = 0; s < 2; ++s) {
            kiln_bar_init(&src_full[s], 1);
            kiln_bar_init(&src_empty[s], PP ? 128 : CW * 128);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    int rank;
    if constexpr (CLUSTER > 1) {
        kiln_cluster_sync();        // the peers' barriers are ready before anything arrives on them
        rank = kiln_cluster_rank();
    } else {
        __syncthreads();
        rank = 0;
    }
    // work units are CLUSTER vertically adjacent tiles, one per CTA of a cluster
    const int tiles_m = (M + BM * CLUSTER - 1) / (BM * CLUSTER), tiles_n = (N + BN - 1) / BN, per_batch = tiles_m * tiles_n;
    const int units = per_batch * BATCH * kiln_split_k_program::SPLIT;
    const int k_tiles = (K + KB - 1) / KB;
    // the ring slot next used and its phase (declared parity first: NVVM then numbers their
    // registers as it did for the kernel before the SDK port, whose PTX this one repeats)
    int parity = 0, stage = 0;
    if (wg == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" :: "n"((int)P::PRODUCER_REGS));
        if (tid >= P::PRODUCERS) return;
        int local = 0;
        for (int unit = blockIdx.x / CLUSTER; unit < units; unit += gridDim.x / CLUSTER, ++local) {
            const Unit u = unit_at<P>(unit, tiles_m, tiles_n, per_batch, BATCH, k_tiles, KT_SPLIT, rank);
            const int bz = u.bz;
            const int64_t m0 = u.m0, n0 = u.n0;
            typename P::Gather gather(tid, m0, KERNEL_ARGS);
            for (int kt = u.kt0; kt < u.kt1; ++kt) {
                kiln_bar_wait(&empty[stage], parity ^ 1);
                uint16_t* as = As + stage * BM * BK;
                uint16_t* bs = Bs + stage * BN * BK;
                const int k0 = kt * KB;
                if (tid == 0) {
                    kiln_bar_expect(&full[stage], P::TMA_BYTES);
                    P::load(as, bs, &full[stage], k0, m0, n0, bz, rank, maps, KERNEL_ARGS);
                }
                gather(as, k0, &full[stage], KERNEL_ARGS);
                if (++stage == STAGES) { stage = 0; parity ^= 1; }
            }
            gather.finish();
            if constexpr (P::NSRC) {
                // the tile's epilogue sources, into buffer local % 2 once its previous tile's epilogue is done
                if (tid == 0) {
                    const int sb = local % 2;
                    kiln_bar_wait(&src_empty[sb], ((local / 2) & 1) ^ 1);
                    kiln_bar_expect(&src_full[sb], SRC_BYTES);
                    P::load_sources(srcs + sb * SRC_BYTES, &src_full[sb], m0, n0, maps);
                }
            }
        }
        asm volatile("cp.async.wait_all;\n" ::: "memory");
        if constexpr (CLUSTER > 1) {
            // the peers' consumers release into this CTA's barriers: stay until the last have arrived
            for (int s = 0; s < STAGES; ++s) {
                kiln_bar_wait(&empty[stage], parity ^ 1);
                if (++stage == STAGES) { stage = 0; parity ^= 1; }
            }
        }
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" :: "n"((int)P::CONSUMER_REGS));
    const int c = wg - 1, t = tid % 128, w = t / 32, lane = t % 32;
    const int SLAB = PP ? 0 : c * MI;    // the consumer's first 64-row slab of the tile
    float acc[MI][BN / 2];
    int local = 0;
    for (int unit = blockIdx.x / CLUSTER; unit < units; unit += gridDim.x / CLUSTER, ++local) {
        const Unit u = unit_at<P>(unit, tiles_m, tiles_n, per_batch, BATCH, k_tiles, KT_SPLIT, rank);
        const int ks = u.ks, bz = u.bz, kt0 = u.kt0, kt1 = u.kt1;
        const int64_t m0 = u.m0, n0 = u.n0;
        if (PP && local % CW != c) {        // the other consumer's tile: skip its stages
            const int passed = stage + (kt1 - kt0);
            stage = passed % STAGES;
            parity ^= (passed / STAGES) & 1;
            continue;
        }
        // what the epilogue reads per row (a residual) goes to L2 while the tile's main loop runs
        for (int p = t; p < 64 * MI * (BN / 32); p += 128) {
            const int64_t m = m0 + SLAB * 64 + p / (BN / 32), n = n0 + p % (BN / 32) * 32;
            if (m < M && n < N) kiln_store_prefetch(KERNEL_ARGS, bz, m, n);
        }
        // ping-pong: one consumer in its main loop at a time (each full barrier then waits on the
        // phase right after the one last seen, so parities cannot alias); named barrier 1 + c
        // means "consumer c may start"
        if (PP && local > 0) asm volatile("bar.sync %0, 256;\n" :: "r"(1 + c) : "memory");
#pragma unroll
        for (int i = 0; i < MI; ++i)
#pragma unroll
            for (int j = 0; j < BN / 2; ++j) acc[i][j] = 0.f;
        fence_accumulators(acc);
        int held = -1;
        for (int kt = kt0; kt < kt1; ++kt) {
            kiln_bar_wait(&full[stage], parity);
            if (P::GATHERED) asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // cp.async wrote it
            const uint16_t* as = As + stage * BM * BK;
            const uint16_t* bs = Bs + stage * BN * BK;
            asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
            for (int kk = 0; kk < BK / 16; ++kk) {
                const uint64_t db = stage_desc<P, P::TRANS_B>(bs, kk);
#pragma unroll
                for (int i = 0; i < MI; ++i) WGMMA(acc[i], (stage_desc<P, P::TRANS_A>(as + (SLAB + i) * 64 * BK, kk)), db);
            }
            asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
            asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
            if (held >= 0) release<P>(&empty[held], lane, rank);
            held = stage;
            if (++stage == STAGES) { stage = 0; parity ^= 1; }
        }
        asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
        fence_accumulators(acc);
        if (held >= 0) release<P>(&empty[held], lane, rank);
        if (PP && unit + gridDim.x / CLUSTER < units) asm volatile("bar.arrive %0, 256;\n" :: "r"(2 - c) : "memory");
        const int sb = local % 2;
        if constexpr (P::NSRC) kiln_bar_wait(&src_full[sb], (local / 2) & 1);
        const unsigned char* tiles = srcs + sb * SRC_BYTES;   // the staged source tiles
        // epilogue: each warp stages 16 x 32 blocks of its accumulators in shared memory and reads
        // them back a row-half per 16 lanes, so each store instruction covers two 128-byte rows;
        // what the epilogue reads per row (a residual) is loaded FETCH blocks ahead of the block
        // being stored, so that that many blocks' loads are in flight at once
        float* staged = epi + (c * 4 + w) * 16 * EPI_LD;
        if constexpr (P::TMA_STORE || P::PACKED) {
            // each warp packs its 16 x 64 blocks of outputs into a 128-byte-swizzled 2 KB tile (in
            // the staging area, unused here) and stores it by TMA, which clips what lies past M and
            // N, or (PACKED) reads it back and stores it from the lanes
            // (an offset from kiln_smem_raw, by which the compiler knows the tile lies in shared memory)
            const int64_t tile_at = (((uint64_t)epi + 1023) & ~(uint64_t)1023) - (uint64_t)kiln_smem_raw;
            unsigned char* packed = kiln_smem_raw + tile_at + (c * 4 + w) * 2048;
#pragma unroll
            for (int i = 0; i < MI; ++i) {
#pragma unroll
                for (int q = 0; q < BN / 64; ++q) {
                    const int64_t m = m0 + (SLAB + i) * 64 + w * 16, n = n0 + q * 64;
                    if constexpr (P::TMA_STORE)
                        if (lane == 0) kiln_bulk_wait_read<0>();      // the tile's last store has read it
                    __syncwarp();
                    pack_block<P>(KERNEL_ARGS, packed, &acc[i][q * 32], bz, m, n, lane);
                    if constexpr (P::TMA_STORE) {
                        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
                        __syncwarp();
                        if (lane == 0) {
                            store_tile<P>(maps.O, packed, (int)n, (int)m, bz);
                            kiln_bulk_commit();
                        }
                    } else {
                        __syncwarp();
                        store_packed<P>(KERNEL_ARGS, packed, bz, m, n, lane);
                    }
                }
            }
        } else if constexpr (VEC > 0) {
            // each lane stores VEC neighbouring outputs of a row (16 bytes) through the vector hook
#pragma unroll
            for (int i = 0; i < MI; ++i) {
#pragma unroll
                for (int q = 0; q < BN / 32; ++q) {
                    stage_block<P>(staged, acc[i], q, lane);
#pragma unroll
                    for (int h = 0; h < 16 / VEC; ++h) {
                        const int row = h * VEC + lane / (32 / VEC), col = lane % (32 / VEC) * VEC;
                        float v[VEC];
#pragma unroll
                        for (int e = 0; e < VEC; e += 4) *(float4*)&v[e] = *(const float4*)&staged[row * EPI_LD + col + e];
                        const int64_t m = m0 + (SLAB + i) * 64 + w * 16 + row, n = n0 + q * 32 + col;
                        if (m < M && n < N) P::store_v(KERNEL_ARGS, tiles, bz, m, n, v, ((SLAB + i) * 64 + w * 16 + row) * BN + q * 32 + col);
                    }
                    __syncwarp();
                }
            }
        } else {
            auto fetch_rows = [&](int i, int q, kiln_fetched* fetched) {
#pragma unroll
                for (int rr = 0; rr < 8; ++rr) {
                    const int64_t m = m0 + (SLAB + i) * 64 + w * 16 + rr * 2 + lane / 16, n = n0 + q * 32 + (lane % 16) * 2;
                    if constexpr (P::FETCHES)
                        if (m < M && n + 1 < N)
                            P::fetch(KERNEL_ARGS, tiles, bz, m, n, fetched[rr], ((SLAB + i) * 64 + w * 16 + rr * 2 + lane / 16) * BN + q * 32 + (lane % 16) * 2);
                }
            };
#pragma unroll
            for (int i = 0; i < MI; ++i) {
                kiln_fetched fetched[FETCH + 1][8];
#pragma unroll
                for (int q = 0; q < FETCH && q < BN / 32; ++q) fetch_rows(i, q, fetched[q]);
#pragma unroll
                for (int q = 0; q < BN / 32; ++q) {
                    if (q + FETCH < BN / 32) fetch_rows(i, q + FETCH, fetched[(q + FETCH) % (FETCH + 1)]);
                    stage_block<P>(staged, acc[i], q, lane);
#pragma unroll
                    for (int rr = 0; rr < 8; ++rr) {
                        const int row = rr * 2 + lane / 16, col = (lane % 16) * 2;
                        const float2 v = *(const float2*)&staged[row * EPI_LD + col];
                        const int64_t m = m0 + (SLAB + i) * 64 + w * 16 + row, n = n0 + q * 32 + col;
                        if (m < M && n + 1 < N)
                            kiln_store2_fetched(KERNEL_ARGS, ks, bz, m, n, v.x, v.y, fetched[q % (FETCH + 1)][rr]);
                        else if (m < M && n < N) kiln_store(KERNEL_ARGS, ks, bz, m, n, v.x);
                    }
                    __syncwarp();
                }
            }
        }
        if constexpr (P::NSRC) kiln_bar_arrive(&src_empty[sb]);
    }
    if constexpr (P::TMA_STORE)
        if (lane == 0) kiln_bulk_wait_read<0>();           // shared memory outlives the last store's reads
}

}  // namespace kiln::sm90
