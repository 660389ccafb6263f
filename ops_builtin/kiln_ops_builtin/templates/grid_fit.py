"""Fitting a contraction's tile and split-K to its shape and the GPU: the templates' `suggest`.

A GEMM of M x N (times a batch) cut into BM x BN tiles makes few blocks when M or N is small
(BERT at 128 tokens: 6 to 24 tiles of 128 x 128 for 132 multiprocessors), and most of the GPU
idles. Smaller tiles and split-K (each of SPLIT blocks takes a share of K, and a second kernel
sums the partials: `kiln_ops_builtin.templates.split_k`) make more blocks, at a price: less
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

from dataclasses import dataclass

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


def cost(tile: Tile, split: int, M: int, N: int, K: int, batch: int, sm_count: int, elem_bytes: int) -> float:
    """Modelled cycles of the contraction (and the split-K sum) with `tile` and `split`."""
    blocks = -(-M // tile.bm) * -(-N // tile.bn) * batch * split
    k_steps = -(-(-(-K // tile.bk)) // split)
    step = tile.bk * max((tile.bm + tile.bn) * elem_bytes / BLOCK_BYTES, tile.bm * tile.bn / tile.rate)
    total = LAUNCH + -(-blocks // sm_count) * (FILL + k_steps * step)
    if split > 1:
        total += LAUNCH + 2 * split * batch * M * N * 4 / (sm_count * SM_BYTES)
    return total


def splits(tile: Tile, M: int, N: int, K: int, batch: int, sm_count: int) -> list[int]:
    """1, and where `tile` makes fewer blocks than SMs, the split counts that leave every split
    at least one k-tile."""
    if -(-M // tile.bm) * -(-N // tile.bn) * batch >= sm_count:
        return [1]
    k_tiles = -(-K // tile.bk)
    return [s for s in range(1, min(MAX_SPLIT, k_tiles) + 1) if -(-k_tiles // s) * (s - 1) < k_tiles]


def rank(tiles: list[Tile], M: int, N: int, K: int, batch: int, sm_count: int, elem_bytes: int) -> list[dict]:
    """Knob settings of every tile and split, cheapest first by `cost` (SPLIT only when > 1)."""
    scored = []
    for order, tile in enumerate(tiles):
        for split in splits(tile, M, N, K, batch, sm_count):
            scored.append((cost(tile, split, M, N, K, batch, sm_count, elem_bytes), order, split, tile))
    scored.sort(key=lambda s: s[:3])
    return [dict(tile.knobs, **({"SPLIT": split} if split > 1 else {})) for _, _, split, tile in scored]
