"""Hopper GEMM engine: matmul, batched matmul and linear in float16/bfloat16 on sm_90a, and in
float32 on TF32 tensor cores where the task allows it (`allow_tf32`, set from torch's
`torch.backends.cuda.matmul.allow_tf32`).

The persistent, warp-specialized kernel of `sm90_engine`, its producer thread issuing TMA
copies (`cp.async.bulk.tensor`, 128-byte swizzled boxes) of both operands.

Layouts are read as they are: a K-contiguous operand is loaded K-major, an M- or N-contiguous
one MN-major (64-element boxes) and multiplied with wgmma's transpose bit, so x @ W and x @ W.T
need no transpose kernel. Batch dimensions are the tensor maps' outer dimensions, per operand,
so an operand broadcast over a batch dimension (stride 0) simply has none. Edges come free: TMA
zero-fills out-of-range boxes and the stores are guarded. Split-K (SPLIT > 1) makes work units
(tile, split) and sums the float32 partials in `split_k`'s kernel.

Declines (older templates take over): other dtypes, float32 without `allow_tf32` or with an
operand that is not K-major (TF32 has no transpose bit), strides TMA cannot describe (every
non-unit stride a multiple of 16 bytes, so K % 8 == 0 for K-major 16-bit rows), more than
three batch dimensions per operand.

Symbolic sizes (`Template.symbolic`): M, N, K, batch dims and strides that vary are kernel
arguments (`Contraction.sizes`), the tensor maps encoded at launch from the values of the run,
so one source serves every size whose knobs are the same (`suggest` buckets sizes by powers of
two). Whatever depends on a value (TMA's 16-byte strides, a batch dim of 1) is decided for each
size as it comes, so a size that differs there gets its own source.

The device code is the engine's (`cuda/sm90_engine.cuh`); this module renders the producer's
copies (`_operand_load`: each operand's `kiln::sm90::load_operand`, multicast in a cluster) as
the engine's program's `load`. Knobs: `GemmKnobs`, whose fields' defaults are the level-0 setting.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from kiln.template import Contraction, CudaProgram, Operand, Template, TensorMapArg, as_dim, dtypes, match_contraction
from kiln_ops_builtin.templates import split_k
from kiln_ops_builtin.templates.sm90_engine import BK, EngineKnobs, Problem, Producer, TmaLoad, k_block, program


@dataclass(frozen=True)
class GemmKnobs(EngineKnobs):
    """The engine's knobs (`sm90_engine.EngineKnobs`), every one of them open to the GEMM. The
    defaults are level 0, `CLUSTERED`: ping-pong 64 x 256 tiles, five stages, in clusters of two
    CTAs sharing B by multicast; and, whatever the tile, 16-bit outputs packed in registers
    (PACKED)."""

    STAGES: int = 5
    PP: int = 1
    CLUSTER: int = 2
    PACKED: int = 1

    @classmethod
    def space(cls, level: int) -> list[GemmKnobs]:
        """Level 0: what large GEMMs take (`CLUSTERED`); 1 and 2 add other tiles (128 x 256 on two
        consumer warpgroups first), depths, ping-pong consumers, clusters of two CTAs sharing B by
        multicast, epilogues storing by TMA or staging float32 accumulators (PACKED = 0) and
        split-K (2: and epilogue fetch depths other than the default)."""
        if level == 0:
            return [CLUSTERED]
        out = [GemmKnobs(**t.knobs) for t in FIT_TILES]
        out += [_k(128, 2, 2, 4), replace(COOPERATIVE, SPLIT=2), replace(COOPERATIVE, CLUSTER=2), CLUSTERED]
        out += [replace(k, TMA_STORE=1) for k in (COOPERATIVE, CLUSTERED, PING_PONG, _k(64, 1, 1, 8))]
        out += [replace(k, PACKED=0) for k in (COOPERATIVE, CLUSTERED, _k(128, 3, 1, 4))]
        if level == 2:
            out += [_k(256, 2, 1, 3), _k(128, 2, 1, 4), _k(128, 2, 2, 3), _k(128, 1, 2, 6), _k(256, 1, 1, 4),
                    _k(192, 2, 1, 4), _k(192, 1, 1, 6), _k(64, 3, 1, 6), replace(PING_PONG, FETCH=1),
                    replace(COOPERATIVE, FETCH=2)]
            out += [replace(k, CLUSTER=2) for k in (_k(128, 2, 1, 6), _k(128, 2, 2, 6, 1), PING_PONG, _k(256, 2, 1, 3))]
        return out


_k = GemmKnobs.tile
COOPERATIVE = _k(256, 2, 1, 4)
"""128 x 256 tiles shared by two consumer warpgroups, four stages."""


def _batch_dims(c: Contraction, operand: Operand) -> list[tuple[int, int, int]] | None:
    """(divisor, size, stride) per tensor-map batch dimension of `operand`, innermost first: the
    coordinate is (bz / divisor) % size. Broadcast (stride 0) and size-1 dims are left out, and
    dims that are one contiguous run merge. None when more than three remain."""
    dims, inner = [], 1
    for size, stride in reversed(list(zip(c.batch, operand.batch_strides))):
        if size > 1 and stride:
            if dims and dims[-1][0] * dims[-1][1] == inner and dims[-1][2] * dims[-1][1] == stride:
                divisor, prev, s = dims[-1]
                dims[-1] = (divisor, prev * size, s)
            else:
                dims.append((inner, size, stride))
        inner *= size
    return dims if len(dims) <= 3 else None


def _operand_load(c: Contraction, operand: Operand, rows: int, extent: int, name: str,
                  parts: int = 1) -> TmaLoad | None:
    """The TMA load of `operand` (extent rows of M or N) as operand `name` in `rows`-row tiles,
    K-major or MN-major as it lies. With `parts` > 1 the tile is shared by a cluster of that
    many CTAs, each loading its part into every CTA's stage by multicast (None where the rows do
    not split so)."""
    batch = _batch_dims(c, operand)
    if batch is None:
        return None
    dims = tuple((c.text(d), c.text(s)) for d, s, _ in batch)
    bdims, bstrides = tuple(as_dim(s) for _, s, _ in batch), tuple(as_dim(st) for _, _, st in batch)
    K, extent = as_dim(c.K), as_dim(extent)
    if operand.k_stride == 1:
        part = rows // parts
        arg = TensorMapArg(operand.param, operand.dtype, (K, extent) + bdims, (1, as_dim(operand.x_stride)) + bstrides,
                           (k_block(operand.dtype), part) + (1,) * len(batch))
        return TmaLoad(name, arg, part, 0, parts, dims)
    if operand.x_stride == 1 and operand.dtype.is_16bit_float and rows // 64 % parts == 0:
        arg = TensorMapArg(operand.param, operand.dtype, (extent, K) + bdims, (1, as_dim(operand.k_stride)) + bstrides,
                           (64, BK) + (1,) * len(batch))
        return TmaLoad(name, arg, rows // 64 // parts, 1, parts, dims)
    return None


def _loads(c: Contraction, bm: int, bn: int, cluster: int = 1) -> tuple[TmaLoad, TmaLoad] | None:
    """The TMA loads of A and B in bm x bn tiles, B shared by clusters of `cluster` CTAs; None
    where TMA cannot load them so."""
    try:
        a = _operand_load(c, c.a, bm, c.M, "A")
        b = _operand_load(c, c.b, bn, c.N, "B", cluster)
    except ValueError:        # strides or boxes TMA cannot take
        return None
    return (a, b) if a and b else None


FIT_TILES = [split_k.Tile(k.as_dict(), k.BM, k.BN, BK, 2048) for k in (
    COOPERATIVE, _k(128, 2, 1, 6), _k(128, 1, 1, 8), _k(256, 1, 1, 5), _k(64, 1, 1, 8), _k(128, 3, 1, 4),
    _k(128, 2, 2, 6, 1), _k(256, 2, 1, 5, 1), _k(128, 2, 1, 8, 1), _k(192, 2, 1, 5, 1))]
"""`suggest`'s tiles (BM x BN: a ping-pong consumer takes a whole 64 * MI-row tile), at wgmma's
2048 float16 MACs per SM clock."""


PING_PONG = _k(128, 2, 1, 8, 1)
CLUSTERED = GemmKnobs()
CLUSTER_WAVES = 4
"""Grids of 16-bit operands of at least CLUSTER_WAVES waves of 64 x 256 tiles that `WAVE_TILES`
gives 128 x 256 take CLUSTERED instead: ping-pong 64 x 256 tiles in clusters of two sharing B by
multicast. On an H200 it was 1.00-1.10x COOPERATIVE on the float16 and bfloat16 squares (8192 x 2048
x 8192: 1.10x) and 4096 x 768 x 3072, and 0.92x on ViT's 1576 x 768 x 2304 (1.7 waves); on TF32
squares 1.04x and 0.96x, so float32 keeps COOPERATIVE."""
TMA_STORE_K_TILES = 2
"""Main loops of at most this many k-tiles (K <= 128 for 16-bit operands: attention's batched
matmuls), whose time goes to writing the output, store it by TMA (`TMA_STORE`) where the tile is
COOPERATIVE, CLUSTERED or PING_PONG. On an H200 (three alternating rounds, each setting against the
same without) that made 32 x 1024 x 128 x 1024 1.30x faster with CLUSTERED (1.013 of cuBLAS)
and 96 x 128 x 64 x 128 1.21x with PING_PONG; on the squares it was 0.88-0.96x with CLUSTERED and
on ViT's linears 0.86-0.99x, so longer main loops pack their outputs in registers (PACKED,
gemm_ab.py on an H200: 1.01-1.12x of the float32-staged epilogue on GPT-2's linears)."""
PACKED_PING_PONG_K_TILES = 16
"""Ping-pong tiles pack their 16-bit outputs in registers (PACKED) only for main loops of at most
this many k-tiles: on longer ones the other consumer's main loop hides the float32-staged
epilogue, and packing was slower (gemm_ab.py, H200, three alternating rounds, ratio to cuBLAS
with CLUSTERED: 8192 x 2048 x 8192 1.11 -> 1.02, 4096 x 4096 x 4096 1.04 -> 1.01-1.04; at K = 768
0.92 -> 1.01)."""

WAVE_TILES = [((128, 256), COOPERATIVE, 1.0), ((192, 128), _k(128, 3, 1, 4), 0.93),
              ((64, 192), _k(192, 2, 1, 5, 1), 0.8), ((64, 128), PING_PONG, 0.7),
              ((64, 128), _k(128, 1, 1, 8), 0.6), ((64, 64), _k(64, 1, 1, 8), 0.4)]
"""(tile, knobs, relative MMA rate): `suggest`'s choices for grids of most of a wave and more,
the rates fitted to the level-2 sweeps on an H200 (benchmarks/HISTORY.md); 64 x 64's to the
batched 96 x 128 x 128 x 64 on an H100, where it beats 64 x 128 tiles half past N by 1.13x."""


def suggest(task, sm_count: int) -> list[dict]:
    """Knob settings for this shape, best guess first, then `split_k.rank`'s ranking of the
    cooperative tiles and split-K. Shapes of at least 0.7 of a wave of 64 x 128 tiles take the
    `WAVE_TILES` entry of least estimated time: waves (rounded up: a partial wave costs a whole
    one) x tile area x (K + a pipeline fill of two k-tiles) / rate; with epilogue sources (a
    residual) and a short main loop, only the entries that can stage them (`staged_stages`);
    16-bit operands without sources in grids of many waves take clusters (`CLUSTER_WAVES`),
    short main loops store by TMA (`TMA_STORE_K_TILES`), and ping-pong tiles with long main loops
    stage their outputs in float32 (`PACKED_PING_PONG_K_TILES`).
    Smaller grids take 64 x 64, split over K up to a wave (at least four k-tiles per split).
    Symbolic sizes count as their bucket (`split_k.bucket`: the power of two at or above the
    value), so that the sizes of a bucket take the same knobs and share one source, built once."""
    c = match_contraction(task)
    M, N, K, batch = (split_k.bucket(x) for x in (c.M, c.N, c.K, c.batch_count))
    ranked = split_k.rank([t for t in FIT_TILES if not t.knobs["PP"]], M, N, K, batch, sm_count, c.a.dtype.nbytes)
    tiles = lambda bm, bn: -(-M // bm) * -(-N // bn) * batch
    k_tiles = -(-K // k_block(c.a.dtype))
    if tiles(64, 128) >= 0.7 * sm_count:
        cost = lambda entry: -(-tiles(*entry[0]) // sm_count) * entry[0][0] * entry[0][1] * (K + 2 * BK) / entry[2]
        staging = [e for e in WAVE_TILES if e[1].staged_stages(c.sources, k_tiles)] if c.sources else []
        first = min(staging or WAVE_TILES, key=cost)[1]
        if (first == COOPERATIVE and c.a.dtype.is_16bit_float and not c.sources
                and tiles(64, 256) >= CLUSTER_WAVES * sm_count):
            first = CLUSTERED
        if k_tiles <= TMA_STORE_K_TILES and first in (COOPERATIVE, CLUSTERED, PING_PONG):
            first = replace(first, TMA_STORE=1)
        if first.PP and k_tiles > PACKED_PING_PONG_K_TILES:
            first = replace(first, PACKED=0)
    else:
        first = _k(64, 1, 1, 8)
        split = min(-(-sm_count // tiles(64, 64)), k_tiles // 4)
        if tiles(64, 64) < 0.5 * sm_count and split > 1:
            first = replace(first, SPLIT=split)
    return [first.as_dict()] + [k for k in ranked if k != first.as_dict()]


def applies(task) -> bool:
    c = match_contraction(task)
    if c is None or c.K <= 0 or c.a.dtype != c.b.dtype:
        return False
    tf32 = c.a.dtype == dtypes.float32 and bool(task.attrs.get("allow_tf32"))
    return ((c.a.dtype.is_16bit_float or tf32)
            and _loads(c, 64, 64) is not None and _loads(c, 256, 256) is not None)


def render(task, **knobs) -> CudaProgram:
    """The engine's program for `task` at the setting `knobs` (`GemmKnobs`' fields)."""
    c: Contraction = match_contraction(task)
    k = GemmKnobs(**knobs)
    loads = _loads(c, k.BM, k.BN, k.CLUSTER)
    if loads is None:
        raise ValueError(f"gemm_sm90: B ({c.N} x {c.K}, {c.b.dtype.name}) cannot be shared by clusters of "
                         f"{k.CLUSTER} at BN={k.BN}: an N-contiguous B splits into 64-column boxes, BN / 64 a multiple "
                         "of it")
    producer = Producer(loads, (k.BM + k.BN) * BK * 2)
    problem = Problem(c.M, c.N, c.K, c.batch_count, c.a.dtype, c.params, c.args, c.epilogue, c.sizes, c.sources,
                      c.output)
    return program("kiln_matmul_sm90", problem, producer, k)


TEMPLATE = Template("gemm_sm90", ("matmul", "linear", "dft"), "cuda", render, priority=30, applies=applies,
                    space=GemmKnobs.settings, min_arch=90, suggest=suggest, reads_views=True, symbolic=True)
