"""Split-K for the contraction templates, and fitting their tile and split to the shape.

A template kernel launched on a grid (tiles, SPLIT, batch) walks only the k-tiles of its split,

    const int KT0 = blockIdx.y * KT_SPLIT, KT = min((K + BK - 1) / BK - KT0, KT_SPLIT);

(k-tiles KT0 .. KT0 + KT - 1; split boundaries are whole k-tiles, so bounds checks against K stay
exact) and hands each finished accumulator to `KILN_STORE(b, m, n, v)` or
`KILN_STORE2(b, m, n, v0, v1)` (n even, n + 1 < N), or, loading what the epilogue reads per row
first, `KILN_FETCH2(b, m, n, f)` into a `kiln_fetched f` and then
`KILN_STORE2_FETCHED(b, m, n, v0, v1, f)`, and `KILN_PREFETCH(b, m, n)` brings what the
epilogue will read per row at (b, m, n .. n + 31) into L2. With SPLIT = 1 these are the core's
epilogue hooks. With SPLIT > 1 they write float32 partials to a workspace temporary
[SPLIT][batch][M][N], and a second kernel, `kiln_split_k_sum`, adds the SPLIT partials of each
element in a fixed order (deterministic, no atomics) and applies the epilogue hooks, so
fusion works the same either way. Symbolic sizes (`kiln.ir.size.SymSize`) are written by the
template's `text` (its `kiln.codegen.sizes.SizeArgs`), the workspace and grids sized by their
values.

The templates' `suggest`: fitting a contraction's tile and split-K to its shape and the GPU.

A GEMM of M x N (times a batch) cut into BM x BN tiles makes few blocks when M or N is small
(BERT at 128 tokens: 6 to 24 tiles of 128 x 128 for 132 multiprocessors), and most of the GPU
idles. Smaller tiles and split-K (above) make more blocks, at a price: less
reuse per loaded byte, and the partials' traffic plus one more launch. A small cost model in SM
clock cycles weighs them:

    time = LAUNCH + waves * (FILL + k_steps * BK * max(load, math))     the contraction
         + [SPLIT > 1] * (LAUNCH + 2 * SPLIT * batch * M * N * 4 / (SMs * SM_BYTES))   the sum

- waves = ceil(blocks / SMs), blocks = tiles * SPLIT; k_steps = ceil(ceil(K / BK) / SPLIT);
- load = (BM + BN) * element bytes / BLOCK_BYTES per k: a block's operand stream, which for a
  lone block per SM is latency-bound (its pipeline stages in flight over the memory latency);
- math = BM * BN / rate per k, `rate` being the tile's MACs per SM clock (the template's
  instruction throughput, lower for small SIMT tiles that reload more per FMA);
- the sum kernel writes and reads the float32 partials at the SM's full bandwidth.

Candidates are the template's tiles (its default first), each unsplit and, where its tiles
alone do not fill one wave (fewer blocks than SMs), split 2..MAX_SPLIT ways with no split left
empty. Ties go to the earlier tile and the smaller split, so a large GEMM (4096^3: 1024 tiles of
128 x 128) keeps the template's default.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kiln.template import KernelArgs, Launch, SymSize, dtypes

SUM_KERNEL = r"""
// out[b, m, n] = epilogue(sum over s of kiln_ws[s][b][m][n]): a thread per two neighbouring columns
extern "C" __global__ void __launch_bounds__(256) kiln_split_k_sum(PARAMS) {
    const int64_t pairs = (N + 1) / 2, total = (int64_t)BATCH * M * pairs, slice = (int64_t)BATCH * M * N;
    for (int64_t i = (int64_t)blockIdx.x * 256 + threadIdx.x; i < total; i += (int64_t)gridDim.x * 256) {
        const int64_t row = i / pairs, n = i % pairs * 2, b = row / M, m = row % M;
        const float* p = kiln_ws + row * N + n;
        float v0 = 0.f, v1 = 0.f;
        if (n + 1 < N) {
#pragma unroll 4
            for (int s = 0; s < SPLIT; ++s) {
                v0 += p[s * slice];
                v1 += p[s * slice + 1];
            }
            kiln_epilogue2(ARGS, b, m, n, v0, v1);
        } else {
#pragma unroll 4
            for (int s = 0; s < SPLIT; ++s) v0 += p[s * slice];
            kiln_epilogue(ARGS, b, m, n, v0);
        }
    }
}
"""

STORE_PARTIAL = "kiln_ws[((int64_t)blockIdx.y * BATCH + (b)) * ((int64_t)M * N) + (m) * (int64_t)N + (n)]"


@dataclass
class SplitK:
    """What split-K adds to a template's program: defines (PARAMS gains the workspace pointer
    when SPLIT > 1), source, the kernel arguments to append and the launches that follow."""

    defines: dict
    source: str = ""
    args: tuple[str, ...] = ()
    launches: list[Launch] = field(default_factory=list)


def _digits(size) -> str:
    return str(int(size))


def plan(split: int, M: int, N: int, K: int, BK: int, batch: int, params: str, args: tuple[str, ...],
         temporaries: list, split_index: str = "blockIdx.y", text=_digits) -> SplitK:
    """Split-K over `split` parts for a template computing a batch x M x N GEMM with k-tiles of
    BK; `params`/`args` are the epilogue hooks' parameters and arguments. The workspace is
    appended to `temporaries` (the program's list). `split_index` is the kernel's expression of
    the split a store belongs to; `text(size)` writes a size (symbolic ones as expressions)."""
    k_tiles = -(-K // BK)
    per_split = f"((int)(({text(K)} + {BK - 1}) / {BK} + {split - 1}) / {split})" if isinstance(K, SymSize) \
        else -(-k_tiles // split)
    defines = {"SPLIT": split, "KT_SPLIT": per_split, "BATCH": text(batch)}
    if split == 1:
        defines.update({"PARAMS": params, "KILN_STORE(b, m, n, v)": "kiln_epilogue(ARGS, b, m, n, v)",
                        "KILN_STORE2(b, m, n, v0, v1)": "kiln_epilogue2(ARGS, b, m, n, v0, v1)",
                        "KILN_FETCH2(b, m, n, f)": "kiln_fetch2(ARGS, b, m, n, f)",
                        "KILN_PREFETCH(b, m, n)": "kiln_prefetch(ARGS, b, m, n)",
                        "KILN_STORE2_FETCHED(b, m, n, v0, v1, f)": "kiln_epilogue2_fetched(ARGS, b, m, n, v0, v1, f)"})
        return SplitK(defines)
    partial = STORE_PARTIAL.replace("blockIdx.y", split_index)
    pair = (f"(*(float2*)&{partial} = make_float2(v0, v1))" if N % 2 == 0 and not isinstance(N, SymSize)
            else f"({partial} = (v0), {partial.replace('(n)]', '(n) + 1]')} = (v1))")     # float2: n even, N even
    defines.update({"PARAMS": f"{params}, float* __restrict__ kiln_ws",
                    "KILN_STORE(b, m, n, v)": f"({partial} = (v))",
                    "KILN_STORE2(b, m, n, v0, v1)": pair,
                    "KILN_FETCH2(b, m, n, f)": "((void)0)",
                    "KILN_PREFETCH(b, m, n)": "((void)0)",
                    "KILN_STORE2_FETCHED(b, m, n, v0, v1, f)": pair})
    workspace = KernelArgs.temporary(len(temporaries))
    temporaries.append(((split, int(batch), int(M), int(N)), dtypes.float32))
    total = int(batch * M * -(-N // 2))
    launch = Launch("kiln_split_k_sum", args + (workspace,), (256, 1, 1), items=total, per_block=256, waves=8)
    return SplitK(defines, SUM_KERNEL, (workspace,), [launch])


# ---------------------------------------------------------------- fitting tile and split

LAUNCH = 1500        # cycles: a dependent kernel's launch gap and first loads
FILL = 500           # cycles: a block's pipeline fill and epilogue
BLOCK_BYTES = 32     # bytes per clock one block streams when alone on its SM
SM_BYTES = 64        # bytes per clock per SM from L2, for the split-K sum
MAX_SPLIT = 16


@dataclass(frozen=True, eq=False)
class Tile:
    """A template's knob setting (without SPLIT) with the tile it computes and its math rate."""

    knobs: dict
    bm: int
    bn: int
    bk: int
    rate: float          # MACs per SM clock
    max_split: int = MAX_SPLIT


def cost(tile: Tile, split: int, M: int, N: int, K: int, batch: int, sm_count: int, elem_bytes: int,
         sm_bytes: float = SM_BYTES) -> float:
    """Modelled cycles of the contraction (and the split-K sum, its partials moved at
    `sm_bytes` per SM clock) with `tile` and `split`."""
    blocks = -(-M // tile.bm) * -(-N // tile.bn) * batch * split
    k_steps = -(-(-(-K // tile.bk)) // split)
    step = tile.bk * max((tile.bm + tile.bn) * elem_bytes / BLOCK_BYTES, tile.bm * tile.bn / tile.rate)
    total = LAUNCH + -(-blocks // sm_count) * (FILL + k_steps * step)
    if split > 1:
        total += LAUNCH + 2 * split * batch * M * N * 4 / (sm_count * sm_bytes)
    return total


def splits(tile: Tile, M: int, N: int, K: int, batch: int, sm_count: int) -> list[int]:
    """1, and where `tile` makes fewer blocks than SMs, the split counts up to the tile's
    `max_split` that leave every split at least one k-tile."""
    if -(-M // tile.bm) * -(-N // tile.bn) * batch >= sm_count:
        return [1]
    k_tiles = -(-K // tile.bk)
    return [s for s in range(1, min(tile.max_split, k_tiles) + 1) if -(-k_tiles // s) * (s - 1) < k_tiles]


def bucket(size) -> int:
    """The size a knob choice takes for `size`: a fixed size itself, a symbolic one
    (`kiln.ir.size.SymSize`) the power of two at or above its value, so that every size of a
    bucket chooses alike and the sizes share one kernel."""
    return 1 << (int(size) - 1).bit_length() if isinstance(size, SymSize) else size


def rank(tiles: list[Tile], M: int, N: int, K: int, batch: int, sm_count: int, elem_bytes: int,
         sm_bytes: float = SM_BYTES) -> list[dict]:
    """Knob settings of every tile and split, cheapest first by `cost` (SPLIT only when > 1)."""
    scored = []
    for order, tile in enumerate(tiles):
        for split in splits(tile, M, N, K, batch, sm_count):
            scored.append((cost(tile, split, M, N, K, batch, sm_count, elem_bytes, sm_bytes), order, split, tile))
    scored.sort(key=lambda s: s[:3])
    return [dict(tile.knobs, **({"SPLIT": split} if split > 1 else {})) for _, _, split, tile in scored]
