"""Fused attention on Hopper (sm_90a): FlashAttention-3's forward, float16 and bfloat16, head
dims 64 and 128 (80 and 96 computed as 128: TMA fills the columns past D with zeros), at least
MIN_QUERIES queries (decoding is `attention_decode`'s) and more keys than one tile of 128 (with
one key tile its pipeline has nothing to overlap: `attention_flash` is faster there, 6.1 against
6.8 us on BERT's 128 tokens on an H200).

A CTA owns BM = 64 * CW queries of one (batch, head) and is warp-specialized. Its producer
warpgroup (registers lowered by `setmaxnreg.dec`) has one thread issue TMA copies
(`cp.async.bulk.tensor`, 128-byte swizzle): the CTA's queries once, then K and V tiles of BN
keys into STAGES-deep rings. Each slot of K and each of V has a *full* mbarrier (the copies'
transaction bytes) and an *empty* one (every consumer thread's release), so that a K slot
frees once its S = Q K^T is done and a V slot once its O += P V is. Tiles are DP / 64 boxes of
64 columns (128 bytes) by their rows, in the layout TMA's swizzle gives (DP: the head dim in
whole boxes). Rows past the queries or keys come as zeros.

CW consumer warpgroups (`setmaxnreg.inc`) own 64 query rows each. Per key tile, S = Q K^T is
`wgmma.mma_async.m64n{BN}k16` with both operands K-major in shared memory (float32
accumulators); the online softmax runs on that fragment in registers (`attention_softmax`: log2
domain, `ex2.approx`, row maxima and sums over a quad, the mask hook, causal and key-length
edges only on the tiles that cross them); P, packed to 16 bits in registers, is wgmma's
register A operand of O += P V, V read from shared memory as an MN-major B operand (the
transpose bit). The tiles overlap inside a warpgroup: tile t's S = Q K^T and tile t - 1's
O += P V are issued together, and tile t's softmax runs while the second is in flight; O is
rescaled once that is done. Causal attention skips the key tiles after a consumer's last row
(it waits for and releases them, since its partner may need them) and masks only the tiles
that cross its diagonal; heavy query blocks start first. A fully masked row keeps sum 0 and
gets zeros, as the operator defines. The output goes through the epilogue hooks, as in
`attention_flash`.

The task is read by `attention_match.match_attention`; q, k and v become tensor maps over
their inputs (columns, rows, then up to three batch dims: [B, L, H, D] views, offsets into a
packed projection and grouped-query heads need no copy; the match already asks for a unit
column stride and the others whole 16 bytes, as TMA does). Operands of more batch dims or rows
at stride 0 are declined, as are decoding shapes, other dtypes and head dims.
Symbolic sizes are kernel arguments as in `attention_flash` (the tensor maps are encoded at
launch from each run's sizes); `suggest` buckets them, so the lengths of a bucket share one
source.

Ranked above `attention_flash` (below `attention_decode`): on an H200 it is 1.25-1.8x torch's
flash backend on 2k-4k tokens, where `attention_flash` is 0.85-0.98x.
"""
from __future__ import annotations

from kiln.template import CudaProgram, Launch, Template, TensorMapArg, dtypes, ptx, template_source
from kiln_ops_builtin.templates import attention_softmax
from kiln_ops_builtin.templates.attention_match import Attention, Strided, match_attention
from kiln_ops_builtin.templates.sm90_engine import MAX_SMEM, SWIZZLE_ATOM, consumer_registers
from kiln_ops_builtin.templates.split_k import bucket

HEAD_DIMS = (64, 80, 96, 128)
MIN_QUERIES = 64
MIN_KEYS = 129
BOX = 64                  # 16-bit columns of a TMA box: 128 bytes, the swizzle's width
PRODUCER_REGS = 24       # the producer's registers (one thread issuing copies) ...
CONSUMER_REGS = 240      # ... and at most the consumers' (their S, P and O fragments)

# What the kernel, and cuda/attention_softmax.cuh's online softmax, read of a program
PROGRAM = """
struct kiln_attention_sm90_program {{
{members}}};
"""

KERNEL = r"""
// the key tiles that rows first .. first + count - 1 (those before LQ) see
static __device__ __forceinline__ int kiln_key_tiles(int first, int count, PARAMS) {
    const int keys = kiln_attention_sm90_program::CAUSAL ? min(LK, min(LQ, first + count)) : LK;
    return (keys + BN - 1) / BN;
}

extern "C" __global__ void __launch_bounds__(128 * (CW + 1), 1) kiln_attention_sm90(KERNEL_PARAMS, TENSOR_MAPS) {
    using P = kiln_attention_sm90_program;
    constexpr bool CAUSAL = P::CAUSAL;
    extern __shared__ unsigned char kiln_smem_raw[];
    uint16_t* Qs = (uint16_t*)(((uint64_t)kiln_smem_raw + 1023) & ~(uint64_t)1023);   // [DP / 64][BM][64]
    uint16_t* Ks = Qs + BM * DP;                      // STAGES x [DP / 64][BN][64], likewise V
    uint16_t* Vs = Ks + STAGES * BN * DP;
    uint64_t* q_full = (uint64_t*)(Vs + STAGES * BN * DP);
    uint64_t* full = q_full + 1;                      // [2][STAGES]: K's slots, then V's
    uint64_t* empty = full + 2 * STAGES;              // likewise
    const int tid = threadIdx.x, wg = tid / 128;
    const int64_t bh = blockIdx.x / M_BLOCKS;
    const int mb = CAUSAL ? M_BLOCKS - 1 - (int)(blockIdx.x % M_BLOCKS) : (int)(blockIdx.x % M_BLOCKS);
    const int m0 = mb * BM, tiles = kiln_key_tiles(m0, BM, ARGS);
    if (tid == 0) {
        kiln_bar_init(q_full, 1);
        for (int s = 0; s < 2 * STAGES; ++s) {
            kiln_bar_init(&full[s], 1);
            kiln_bar_init(&empty[s], CW * 128);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    if (wg == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" :: "n"(PRODUCER_REGS));
        if (tid == 0) {
            kiln_bar_expect(q_full, BM * DP * 2);
#pragma unroll
            for (int c = 0; c < DP / 64; ++c) LOAD_Q(Qs + c * BM * 64, q_full, c * 64, m0);
            for (int t = 0; t < tiles; ++t) {
                const int s = t % STAGES, phase = ((t / STAGES) & 1) ^ 1;
                kiln_bar_wait(&empty[s], phase);
                kiln_bar_expect(&full[s], BN * DP * 2);
#pragma unroll
                for (int c = 0; c < DP / 64; ++c) LOAD_K(Ks + (s * DP / 64 + c) * BN * 64, &full[s], c * 64, t * BN);
                kiln_bar_wait(&empty[STAGES + s], phase);
                kiln_bar_expect(&full[STAGES + s], BN * DP * 2);
#pragma unroll
                for (int c = 0; c < DP / 64; ++c)
                    LOAD_V(Vs + (s * DP / 64 + c) * BN * 64, &full[STAGES + s], c * 64, t * BN);
            }
        }
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" :: "n"(CONSUMER_REGS));
    const int c = wg - 1, lane = tid % 32, rows = m0 + c * 64, row = rows + (tid % 128) / 32 * 16;
    const int mine = rows < LQ ? kiln_key_tiles(rows, 64, ARGS) : 0;   // the tiles this consumer's rows see
    const uint16_t* qs = Qs + c * 64 * 64;
    float o[DP / 2], s[BN / 2], mx[2] = {-INFINITY, -INFINITY}, sum[2] = {0.f, 0.f}, alpha[2];
    unsigned p[BN / 4];
#pragma unroll
    for (int e = 0; e < DP / 2; ++e) o[e] = 0.f;
    // tile t's K (x = 0) or V (x = 1): waiting for its copies, releasing its slot
    auto await = [&](int x, int t) { kiln_bar_wait(&full[x * STAGES + t % STAGES], (t / STAGES) & 1); };
    auto release = [&](int x, int t) { kiln_bar_arrive(&empty[x * STAGES + t % STAGES]); };
    // S = Q K^T of tile t, issued
    auto scores = [&](int t) {
        const uint16_t* ks = Ks + t % STAGES * BN * DP;
        kiln_wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < DP / 16; ++kk)
            WGMMA_QK(s, kiln_gdesc(qs + kk / 4 * BM * 64, 16, SWIZZLE_ATOM) + 2 * (kk % 4),
                     kiln_gdesc(ks + kk / 4 * BN * 64, 16, SWIZZLE_ATOM) + 2 * (kk % 4), kk);
        kiln_wgmma_commit();
    };
    // O += P V of tile t, issued
    auto values = [&](int t) {
        const uint16_t* vs = Vs + t % STAGES * BN * DP;
        kiln_wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) WGMMA_PV(o, &p[4 * kk], kiln_gdesc(vs + kk * 16 * 64, BN * 128, SWIZZLE_ATOM));
        kiln_wgmma_commit();
    };
    // the online softmax of tile t's scores, edges masked where the tile crosses one
    auto softmax = [&](int t) {
        const int n0 = t * BN;
        if (n0 + BN > LK || (CAUSAL && n0 + BN - 1 > row))
            kiln::attention::softmax_step<P, true, BN / 8>(s, mx, sum, alpha, row, n0, bh, lane, ARGS);
        else
            kiln::attention::softmax_step<P, false, BN / 8>(s, mx, sum, alpha, row, n0, bh, lane, ARGS);
    };
    auto pack = [&]() {
#pragma unroll
        for (int e = 0; e < BN / 4; ++e) p[e] = PACK(s[2 * e], s[2 * e + 1]);
    };
    if (mine > 0) {
        kiln_bar_wait(q_full, 0);
        await(0, 0);
        scores(0);
        kiln_wgmma_wait<0>();
        kiln_wgmma_keep<BN / 2>(s);
        release(0, 0);
        softmax(0);
        pack();
        for (int t = 1; t < mine; ++t) {
            await(0, t);
            scores(t);
            await(1, t - 1);
            values(t - 1);
            kiln_wgmma_wait<1>();
            kiln_wgmma_keep<BN / 2>(s);
            release(0, t);
            softmax(t);
            kiln_wgmma_keep<BN / 2>(s);               // the softmax runs before the wait, beside the P V product
            kiln_wgmma_wait<0>();
            kiln_wgmma_keep<DP / 2>(o);
            kiln_wgmma_keep<BN / 4>(p);
            release(1, t - 1);
            kiln::attention::rescale_rows<DP / 8>(o, alpha);
            pack();
        }
        await(1, mine - 1);
        values(mine - 1);
        kiln_wgmma_wait<0>();
        kiln_wgmma_keep<DP / 2>(o);
        release(1, mine - 1);
    }
    for (int t = mine; t < tiles; ++t) {          // tiles only the other consumers' rows see
        await(0, t);
        release(0, t);
        await(1, t);
        release(1, t);
    }
    if (mine > 0) kiln::attention::store_rows<D / 8>(o, sum, row, bh, lane, ARGS);
}
"""


def _k(bn: int, cw: int, stages: int) -> dict:
    return {"BN": bn, "CW": cw, "STAGES": stages}


def padded(d: int) -> int:
    """The head dim as the tiles hold it: whole 64-column boxes."""
    return -(-d // BOX) * BOX


def smem_bytes(knobs: dict, dp: int) -> int:
    """The queries, STAGES slots of K and V, the mbarriers and 1024 bytes of alignment."""
    return (64 * knobs["CW"] + 2 * knobs["STAGES"] * knobs["BN"]) * dp * 2 + 8 * (1 + 4 * knobs["STAGES"]) + 1024


def fits(knobs: dict, dp: int = 128) -> bool:
    """Whether the setting is one wgmma can run (BN a multiple of 16, at most 256) and fits
    shared memory and the consumers' registers (O, S and P of a thread, and a working set)."""
    bn, cw = knobs["BN"], knobs["CW"]
    regs = dp // 2 + bn // 2 + bn // 4 + 30
    return (bn % 16 == 0 and 16 <= bn <= 256 and cw in (1, 2) and knobs["STAGES"] >= 2
            and smem_bytes(knobs, dp) <= MAX_SMEM and regs <= _consumer_registers(cw))


def _consumer_registers(cw: int) -> int:
    return consumer_registers(cw, PRODUCER_REGS, CONSUMER_REGS)


def space(level: int) -> list[dict]:
    """Level 0: 128 queries on two consumer warpgroups, 128-key tiles, two stages; 1: 64- and
    176-key tiles, one consumer, three stages; 2: every setting that fits head dim 128."""
    if level == 0:
        return [_k(128, 2, 2)]
    if level == 1:
        return [_k(128, 2, 2), _k(64, 2, 2), _k(176, 2, 2), _k(128, 1, 2), _k(128, 2, 3)]
    return [k for bn in (64, 128, 176) for cw in (1, 2) for stages in (2, 3) if fits(k := _k(bn, cw, stages))]


def _tensor_map(a: Attention, x: Strided, rows, box_rows: int) -> tuple[TensorMapArg, str]:
    """The tensor map of operand `x` (columns, `rows` rows, its batch dims) with boxes of 64
    columns by `box_rows` rows, and the C of its batch coordinates for flat batch index bh
    (", c2, c3 .."); raises ValueError where TMA cannot describe it."""
    dims = a.batch_dims(x, "bh")
    if len(dims) > 3:
        raise ValueError(f"{len(dims)} batch dims (TMA takes ranks up to 5)")
    if not x.row_stride:
        raise ValueError("rows at stride 0 (a single key, or keys broadcast along the sequence)")
    arg = TensorMapArg(x.param, x.dtype, (a.D, int(rows)) + tuple(int(e) for _, _, e in dims),
                       (1, int(x.row_stride)) + tuple(int(s) for _, s, _ in dims), (BOX, box_rows) + (1,) * len(dims),
                       offset=int(x.offset))
    return arg, "".join(f", (int){c}" for c, _, _ in dims)


def _maps(a: Attention, bm: int, bn: int):
    """(name, tensor map, C coordinates) of q, k and v, or None where TMA cannot take one."""
    try:
        return [(name, *_tensor_map(a, x, rows, box)) for name, x, rows, box in
                (("Q", a.q, a.Lq, bm), ("K", a.k, a.Lk, bn), ("V", a.v, a.Lk, bn))]
    except ValueError:
        return None


def applies(task) -> bool:
    """16-bit attention with D == Dv among HEAD_DIMS, at least MIN_QUERIES queries and MIN_KEYS
    keys (a symbolic length by its bucket), and operands TMA can read (unit column stride, the
    others whole 16 bytes, at most three batch dims)."""
    a = match_attention(task)
    return (a is not None and a.dtype in (dtypes.float16, dtypes.bfloat16) and a.q.dtype == a.k.dtype == a.v.dtype
            and a.D == a.Dv and a.D in HEAD_DIMS and a.Lq >= MIN_QUERIES and bucket(a.Lk) >= MIN_KEYS
            and _maps(a, 128, 128) is not None)


def suggest(task, sm_count: int) -> list[dict]:
    """128 queries on two consumers, or 64 on one where 128-query blocks would not fill the GPU;
    176-key tiles for long keys at head dim 128 without causal edge or mask (FlashAttention-3's
    choice; with either, the index arithmetic of the edges spills at 176), else 128; two
    stages; then `space(1)`. Symbolic sizes count as their bucket (`split_k.bucket`),
    so that the lengths of a bucket share one source."""
    a = match_attention(task)
    Lq, Lk, batch = (bucket(x) for x in (a.Lq, a.Lk, a.batch_count))
    cw = 2 if -(-Lq // 128) * batch >= sm_count else 1
    bn = 176 if padded(a.D) == 128 and not a.causal and a.mask is None and Lk >= 1024 else 128
    first = _k(bn, cw, 2)
    return [first] + [k for k in space(1) if k != first]


def render(task, BN, CW, STAGES) -> CudaProgram:
    """The kernel for `task` (see the module doc)."""
    a: Attention = match_attention(task)
    dp, knobs = padded(a.D), _k(BN, CW, STAGES)
    if not fits(knobs, dp):
        raise ValueError(f"attention_sm90: invalid knobs {knobs} for head dim {a.D} (BN a multiple of 16 up to 256, "
                         f"CW 1 or 2, STAGES >= 2, at most {MAX_SMEM} bytes of shared memory and the consumers' "
                         "registers)")
    bm = 64 * CW
    maps = _maps(a, bm, BN)
    if maps is None:
        raise ValueError(f"attention_sm90: TMA cannot read the operands of {task!r}; `applies` declines it")
    m_blocks = (a.Lq + bm - 1) // bm
    defines = {
        **a.device_defines(), "D": a.D, "PACK": ptx.pack_16x2(a.dtype), "DP": dp, "BM": bm, "BN": BN, "CW": CW,
        "STAGES": STAGES, "M_BLOCKS": a.int_text(m_blocks), "SWIZZLE_ATOM": SWIZZLE_ATOM, "KERNEL_PARAMS": a.params,
        "TENSOR_MAPS": ", ".join(f"const __grid_constant__ CUtensorMap tm{name}" for name, _, _ in maps),
        "PRODUCER_REGS": PRODUCER_REGS, "CONSUMER_REGS": _consumer_registers(CW),
        **{f"LOAD_{name}(DST, BAR, COL, ROW)": f"kiln_tma_{len(arg.dims)}d(DST, &tm{name}, BAR, COL, ROW{coords})"
           for name, arg, coords in maps},
    }
    kernels = [ptx.wgmma_m64k16(BN, a.dtype, 0, 0, "WGMMA_QK", scale_d=True),
               ptx.wgmma_m64k16_rs(dp, a.dtype, 1, "WGMMA_PV"), attention_softmax.CODE,
               PROGRAM.format(members=attention_softmax.members(a)), KERNEL]
    source = template_source(kernels, defines, a.hooks, (ptx.MBARRIER, ptx.TMA, ptx.WGMMA, ptx.CVT_EX2))
    launch = Launch("kiln_attention_sm90", tuple(a.args.split(", ")) + tuple(arg for _, arg, _ in maps),
                    (128 * (CW + 1), 1, 1), grid=(int(m_blocks * a.batch_count), 1, 1), smem=smem_bytes(knobs, dp))
    return CudaProgram(source, [launch], arch_suffix="a", min_arch=90, alignment=16, sizes=a.sizes.values)


TEMPLATE = Template("attention_sm90", ("attention",), "cuda", render, priority=15, applies=applies, space=space,
                    min_arch=90, suggest=suggest, reads_views=True, symbolic=True)
