"""Split-K for the contraction templates, and fitting their tile and split to the shape.

A template kernel launched on a grid (tiles, SPLIT, batch) walks only the k-tiles of its split,

    const int KT0 = blockIdx.y * KT_SPLIT, KT = min((K + BK - 1) / BK - KT0, KT_SPLIT);

(k-tiles KT0 .. KT0 + KT - 1; split boundaries are whole k-tiles, so bounds checks against K stay
exact) and hands each finished accumulator to split_k's stores, device functions taking the
kernel's arguments (`KERNEL_ARGS`), the split and the element: `kiln_store(KERNEL_ARGS, split, b,
m, n, v)` or `kiln_store2(KERNEL_ARGS, split, b, m, n, v0, v1)` (n even, n + 1 < N), or, loading
what the epilogue reads per row first, `kiln_store_fetch2(KERNEL_ARGS, b, m, n, f)` into a
`kiln_fetched f` and then `kiln_store2_fetched(KERNEL_ARGS, split, b, m, n, v0, v1, f)`, and
`kiln_store_prefetch(KERNEL_ARGS, b, m, n)` brings what the epilogue will read per row at (b, m,
n .. n + 31) into L2. With SPLIT = 1 these are the core's epilogue hooks
(`cuda/split_k_direct.cuh`). With SPLIT > 1 (`cuda/split_k.cuh`) they write float32 partials to
a workspace temporary [SPLIT][batch][M][N], and a second kernel, `kiln_split_k_sum`
(`cuda/split_k_sum.cuh`), adds the SPLIT partials of each element in a fixed order
(deterministic, no atomics) and applies the epilogue hooks, so fusion works the same either way.

On sm_90 a template whose block owns a tile of Rows x Columns outputs may split K without the
workspace and the second kernel (CLUSTER): the SPLIT blocks of a tile launch as one thread-block
cluster along x (grid (tiles * SPLIT, 1, batch), SPLIT <= MAX_CLUSTER, the portable cluster
size), each keeps its float32 partial of the tile in its shared memory, and after a cluster
barrier each block adds the SPLIT partials of its slice of the tile through distributed shared
memory, the same additions in the same order as the sum kernel's, and stores them through the
epilogue hooks (the stores are `cuda/split_k_direct.cuh`'s).
`kiln_split_k_tiles<Rows, Columns>(n, part, store)` (`cuda/split_k_tiles.cuh`) runs such a
block, either way: `part(tile, split, store)` computes a tile's partial over a split's k-tiles,
`store(split, m, n, v)` is the template's call of `kiln_store`.

The program renders `kiln_split_k_program` (SPLIT, FLOAT2_PAIRS: whether a pair of partials
stores as one float2, and CLUSTER) and defines KT_SPLIT, BATCH, PARAMS (the kernel's
parameters: the hooks', then the workspace) and KERNEL_ARGS; the template defines M, N, K and
ARGS (the hooks' arguments). Symbolic sizes (`kiln.ir.size.SymSize`) are written by the
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

from kiln.template import KernelArgs, Launch, SymSize, as_dim, device_code, dtypes

PROGRAM = "struct kiln_split_k_program {{ enum {{ SPLIT = {split}, FLOAT2_PAIRS = {pairs}, CLUSTER = {cluster} }}; }};\n"
MAX_CLUSTER = 8      # blocks of a portable thread-block cluster


@dataclass
class SplitK:
    """What split-K adds to a template's program: defines (PARAMS gains the workspace pointer
    when SPLIT > 1, KERNEL_ARGS are the kernel's arguments), `stores` (device code to place ahead
    of the template's kernel: `kiln_split_k_program` and the stores), `source` (to place after it:
    the sum kernel when SPLIT > 1), the kernel arguments to append and the launches that follow."""

    defines: dict
    stores: str
    source: str = ""
    args: tuple[str, ...] = ()
    launches: list[Launch] = field(default_factory=list)


def clusters(split: int) -> bool:
    """Whether `split` splits may meet in a thread-block cluster (`plan`'s `cluster`): 2 to
    MAX_CLUSTER."""
    return 1 < split <= MAX_CLUSTER


def _digits(size) -> str:
    return str(int(size))


def plan(split: int, M: int, N: int, K: int, BK: int, batch: int, params: str, args: tuple[str, ...],
         temporaries: list, text=_digits, cluster: bool = False) -> SplitK:
    """Split-K over `split` parts for a template computing a batch x M x N GEMM with k-tiles of
    BK; `params`/`args` are the epilogue hooks' parameters and arguments. The workspace is
    appended to `temporaries` (the program's list). `text(size)` writes a size (symbolic ones as
    expressions). With `cluster` (sm_90, 1 < `split` <= MAX_CLUSTER) the splits meet in a
    thread-block cluster instead (`kiln_split_k_tiles`): no workspace, no sum kernel. The device
    code is `cuda/split_k_direct.cuh` (SPLIT = 1, or `cluster`), or `cuda/split_k.cuh` and
    `cuda/split_k_sum.cuh`."""
    if cluster and not clusters(split):
        raise ValueError(f"split_k: a cluster takes 2 to {MAX_CLUSTER} splits, not {split}")
    k_tiles = -(-K // BK)
    per_split = f"((int)(({text(K)} + {BK - 1}) / {BK} + {split - 1}) / {split})" if isinstance(K, SymSize) \
        else -(-k_tiles // split)
    program = PROGRAM.format(split=split, pairs=int(N % 2 == 0 and not isinstance(N, SymSize)), cluster=int(cluster))
    defines = {"KT_SPLIT": per_split, "BATCH": text(batch)}
    if split == 1 or cluster:
        defines.update({"PARAMS": params, "KERNEL_ARGS": "ARGS"})
        return SplitK(defines, program + device_code(__package__, "cuda/split_k_direct.cuh"))
    defines.update({"PARAMS": f"{params}, float* __restrict__ kiln_ws", "KERNEL_ARGS": "ARGS, kiln_ws"})
    workspace = KernelArgs.temporary(len(temporaries))
    temporaries.append(((split, as_dim(batch), as_dim(M), as_dim(N)), dtypes.float32))
    total = as_dim(batch * M * -(-N // 2))
    launch = Launch("kiln_split_k_sum", args + (workspace,), (256, 1, 1), items=total, per_block=256, waves=8)
    return SplitK(defines, program + device_code(__package__, "cuda/split_k.cuh"),
                  device_code(__package__, "cuda/split_k_sum.cuh"), (workspace,), [launch])


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
    bucket chooses alike and the sizes share one kernel (found by comparisons, which a plan
    reused at another size asks again: `kiln.ir.size_reads`)."""
    if not isinstance(size, SymSize):
        return size
    power = 1
    while power < size:
        power *= 2
    return power


def rank(tiles: list[Tile], M: int, N: int, K: int, batch: int, sm_count: int, elem_bytes: int,
         sm_bytes: float = SM_BYTES) -> list[dict]:
    """Knob settings of every tile and split, cheapest first by `cost` (SPLIT only when > 1)."""
    scored = []
    for order, tile in enumerate(tiles):
        for split in splits(tile, M, N, K, batch, sm_count):
            scored.append((cost(tile, split, M, N, K, batch, sm_count, elem_bytes, sm_bytes), order, split, tile))
    scored.sort(key=lambda s: s[:3])
    return [dict(tile.knobs, **({"SPLIT": split} if split > 1 else {})) for _, _, split, tile in scored]
