"""Convolutions in float16/bfloat16 as implicit GEMM on tensor cores (sm_80+).

The task is seen as a GEMM through the core's load hooks (`kiln.codegen.hooks.match_hooked_gemm`:
m enumerates output pixels, n output channels, k input channels x kernel taps; im2col and the
zero padding are computed on the fly). A block computes a BM x BN tile with warps of WM x WN
tiles. Each k-step of BK = 32 is read into registers through the hooks, eight neighbouring k
per thread packed into one 16-byte store into a k-major, XOR-swizzled shared-memory tile
(matmul_tc's layout, so `ldmatrix` and the stores do not conflict on banks), double-buffered:
the next step is read while the current one is multiplied by `mma.sync.m16n8k16` into float32
accumulators. Outputs go through the epilogue hook (bias, activation, cast).

Small GEMMs (batch 1, late layers: M = 49) would leave most multiprocessors idle, so K is split
over SPLIT blocks (`kiln_ops_builtin.templates.split_k`: float32 partials, then a kernel that
adds them and applies the epilogue). Knobs at 0 are chosen from the problem size.

Symbolic sizes (`Template.symbolic`): a symbolic batch (so M) is a kernel argument
(`HookedGemm.sizes`); the knobs chosen from M and N take their bucket (`split_k.bucket`), so
the batches of a bucket share one source.
"""
from __future__ import annotations

from kiln.template import CudaProgram, Launch, Template, dtypes, match_hooked_gemm, ptx, template_source

from kiln_ops_builtin.templates import split_k
from kiln_ops_builtin.templates.matmul_tc import MMA_STEP

BK = 32
BLOCKS_WANTED = 128          # about one wave of blocks on current data-centre GPUs
TILES = [(128, 128, 64, 64), (128, 64, 64, 32), (64, 128, 32, 64), (64, 64, 32, 32)]   # (BM, BN, WM, WN), largest first
SMALL_M_TILE = (32, 64, 16, 32)
DEFAULT = {"BM": 0, "BN": 0, "WM": 0, "WN": 0, "SPLIT": 0}

KERNEL = r"""
#define PACK(lo, hi) ((uint32_t)TO16(lo) | ((uint32_t)TO16(hi) << 16))
// GEMM indices are below 2^31: passed to the hooks zero-extended from 32 bits, so that the
// compiler can narrow the hooks' index divisions (im2col) to 32-bit arithmetic
#define IDX(v) ((int64_t)(uint32_t)(v))
extern "C" __global__ void __launch_bounds__(NT) kiln_conv_tc(PARAMS) {
    __shared__ __align__(128) uint16_t As[2][BM * BK];
    __shared__ __align__(128) uint16_t Bs[2][BN * BK];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp / (BN / WN), wn = warp % (BN / WN);
    const int tiles_n = (N + BN - 1) / BN;
    const int64_t m0 = (int64_t)(blockIdx.x / tiles_n) * BM, n0 = (int64_t)(blockIdx.x % tiles_n) * BN;
    const int KT = (K + BK - 1) / BK, kt0 = blockIdx.y * KT_SPLIT, kt1 = min(KT, kt0 + KT_SPLIT);
    // a thread reads eight neighbouring k of one row per copy: A's rows (output pixels) vary
    // fastest across threads, so the input's neighbouring pixels are read together
    uint4 ra[LA], rb[LB];
    auto fetch = [&](int kt) {
#pragma unroll
        for (int i = 0; i < LA; ++i) {
            const int idx = tid + i * NT, r = idx % BM, c = idx / BM;
            const int64_t gm = m0 + r, gk = (int64_t)kt * BK + c * 8;
            float v[8];
#pragma unroll
            for (int e = 0; e < 8; ++e) v[e] = gm < M && gk + e < K ? kiln_load_a(ARGS, IDX(gm), IDX(gk + e)) : 0.f;
            ra[i] = make_uint4(PACK(v[0], v[1]), PACK(v[2], v[3]), PACK(v[4], v[5]), PACK(v[6], v[7]));
        }
#pragma unroll
        for (int i = 0; i < LB; ++i) {
            const int idx = tid + i * NT, r = idx / (BK / 8), c = idx % (BK / 8);
            const int64_t gn = n0 + r, gk = (int64_t)kt * BK + c * 8;
            float v[8];
#pragma unroll
            for (int e = 0; e < 8; ++e) v[e] = gn < N && gk + e < K ? kiln_load_b(ARGS, IDX(gk + e), IDX(gn)) : 0.f;
            rb[i] = make_uint4(PACK(v[0], v[1]), PACK(v[2], v[3]), PACK(v[4], v[5]), PACK(v[6], v[7]));
        }
    };
    auto stash = [&](int buf) {
#pragma unroll
        for (int i = 0; i < LA; ++i) {
            const int idx = tid + i * NT, r = idx % BM, c = idx / BM;
            *(uint4*)&As[buf][r * BK + kiln_swz(r, c, BK / 8) * 8] = ra[i];
        }
#pragma unroll
        for (int i = 0; i < LB; ++i) {
            const int idx = tid + i * NT, r = idx / (BK / 8), c = idx % (BK / 8);
            *(uint4*)&Bs[buf][r * BK + kiln_swz(r, c, BK / 8) * 8] = rb[i];
        }
    };
    float acc[WM / 16][WN / 8][4];
#pragma unroll
    for (int i = 0; i < WM / 16; ++i)
#pragma unroll
        for (int j = 0; j < WN / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;
    if (kt0 < kt1) {
        fetch(kt0);
        stash(0);
    }
    __syncthreads();
    for (int kt = kt0; kt < kt1; ++kt) {
        const int cur = (kt - kt0) & 1;
        if (kt + 1 < kt1) fetch(kt + 1);
        const uint16_t* as = As[cur];
        const uint16_t* bs = Bs[cur];
        kiln_mma_step(acc, as, bs, wm, wn, lane);
        if (kt + 1 < kt1) stash(cur ^ 1);
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < WM / 16; ++i)
#pragma unroll
        for (int j = 0; j < WN / 8; ++j)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int64_t m = m0 + wm * WM + i * 16 + (lane >> 2) + h * 8;
                const int64_t n = n0 + wn * WN + j * 8 + (lane & 3) * 2;
                if (m < M && n + 1 < N) KILN_STORE2(0, m, n, acc[i][j][2 * h], acc[i][j][2 * h + 1]);
                else if (m < M && n < N) KILN_STORE(0, m, n, acc[i][j][2 * h]);
            }
}
"""


def valid(BM: int, BN: int, WM: int, WN: int) -> bool:
    """Whether a tile makes a launchable kernel: whole warp tiles of 16 x 16 multiples, 2 to 8
    warps, and whole 16-byte copies per thread."""
    if min(BM, BN, WM, WN) <= 0 or BM % WM or BN % WN or WM % 16 or WN % 16:
        return False
    nt = (BM // WM) * (BN // WN) * 32
    return 64 <= nt <= 256 and (BM * BK // 8) % nt == 0 and (BN * BK // 8) % nt == 0


def _tiles(M: int, N: int, tile) -> int:
    return -(-M // tile[0]) * -(-N // tile[1])


def auto_tile(M: int, N: int) -> tuple[int, int, int, int]:
    """The largest tile that gives about a wave of blocks with at most a quarter of it past
    the GEMM's edges; the smallest otherwise (a 32-row tile where M fits in it)."""
    for tile in TILES:
        blocks = _tiles(M, N, tile)
        if blocks >= BLOCKS_WANTED and M * N >= 0.75 * blocks * tile[0] * tile[1]:
            return tile
    return SMALL_M_TILE if M <= 32 else TILES[-1]


def auto_split(blocks: int, k_steps: int) -> int:
    """K split in powers of two while the grid stays within about a wave and each part keeps
    at least four k-steps."""
    split = 1
    while blocks * split * 2 <= BLOCKS_WANTED and k_steps >= split * 2 * 4:
        split *= 2
    return split


def space(level: int) -> list[dict]:
    """Level 0: tile and split chosen from the problem size; level 1 adds each tile with the
    automatic split; level 2 adds splits of 1, 2, 4 and 8 for each tile."""
    out = [dict(DEFAULT)]
    tiles = TILES + [SMALL_M_TILE]
    if level >= 1:
        out += [{"BM": t[0], "BN": t[1], "WM": t[2], "WN": t[3], "SPLIT": 0} for t in tiles]
    if level >= 2:
        out += [{"BM": t[0], "BN": t[1], "WM": t[2], "WN": t[3], "SPLIT": s} for t in tiles for s in (1, 2, 4, 8)]
    return out


def _operand_dtype(task):
    """The one 16-bit float type of the task's inputs, or None."""
    found = {t.dtype for t in task.inputs}
    return found.pop() if len(found) == 1 and found <= {dtypes.float16, dtypes.bfloat16} else None


def applies(task) -> bool:
    g = match_hooked_gemm(task)
    return (g is not None and g.acc_dtype == dtypes.float32 and _operand_dtype(task) is not None
            and max(g.M, g.N, g.K) < 2 ** 31)


def render(task, BM=0, BN=0, WM=0, WN=0, SPLIT=0) -> CudaProgram:
    g = match_hooked_gemm(task)
    M, N = split_k.bucket(g.M), split_k.bucket(g.N)
    if BM == 0:
        BM, BN, WM, WN = auto_tile(M, N)
    if not valid(BM, BN, WM, WN):
        raise ValueError(f"invalid conv_tc tile {BM}x{BN}, warp tile {WM}x{WN}")
    nt = (BM // WM) * (BN // WN) * 32
    k_steps = -(-g.K // BK)
    split = SPLIT or auto_split(_tiles(M, N, (BM, BN)), k_steps)
    per_split = -(-k_steps // split)
    split = -(-k_steps // per_split)          # no empty parts
    temporaries = []
    sk = split_k.plan(split, g.M, g.N, g.K, BK, 1, g.params, tuple(g.args.split(", ")), temporaries, text=g.text)
    is_f16 = _operand_dtype(task) == dtypes.float16
    defines = {"NT": nt, "BM": BM, "BN": BN, "BK": BK, "WM": WM, "WN": WN, "LA": BM * BK // 8 // nt,
               "LB": BN * BK // 8 // nt, "M": g.text(g.M), "N": g.text(g.N), "K": g.text(g.K), "ARGS": g.args,
               "B_K_CONTIGUOUS": 1, "TO16(x)": "kiln_f2h(x)" if is_f16 else "kiln_f2bf(x)", **sk.defines}
    source = template_source([MMA_STEP, KERNEL, sk.source], {**defines, "MMA": ptx.mma_m16n8k16(_operand_dtype(task))},
                             g.hooks, (ptx.LDMATRIX, ptx.MMA))
    launch = Launch("kiln_conv_tc", tuple(g.args.split(", ")) + sk.args, (nt, 1, 1),
                    grid=(int(_tiles(g.M, g.N, (BM, BN))), split, 1))
    return CudaProgram(source, [launch] + sk.launches, temporaries, alignment=16, sizes=g.sizes.values)


TEMPLATE = Template("conv_tc", ("conv1d", "conv2d", "conv_transpose2d", "conv2d_channels_last"), "cuda", render,
                    priority=20, applies=applies, space=space, symbolic=True)
