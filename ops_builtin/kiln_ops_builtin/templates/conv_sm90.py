"""Hopper implicit-GEMM convolution: `conv2d_channels_last` in float16/bfloat16 on sm_90a, and
in float32 on TF32 tensor cores where the task allows it (`allow_tf32`, which the torch backend
sets from `torch.backends.cudnn.allow_tf32`).

The convolution (`conv_nhwc.match_conv_nhwc`) is the GEMM M = batch * out_h * out_w output
pixels, N = out channels, K = kh * kw * channels, K contiguous in x and in the weight, run on the
Hopper engine (`sm90_engine`: persistent warp-specialized wgmma kernel, mbarrier ring, epilogue
through the core's hooks, so fused bias, folded batch norm, activations and residual adds land
there; grouped rasterization; split-K). B, the weight viewed as [N, K] K-major, comes by TMA.
A, the im2col of x, is no TMA box: all 128 producer threads gather it with 16-byte
`cp.async.cg` copies (eight channels of one tap of one output pixel, four in float32;
zero-filled, src-size 0,
for padding, rows past M and k past K) into the 128-byte-swizzled K-major layout TMA would
write, so the consumers' wgmma descriptors are unchanged, and arrive on the slot's full barrier
with `cp.async.mbarrier.arrive.noinc`. Thread t copies 16-byte column t % 8 of rows t / 8 + 16 i:
eight neighbouring threads read one pixel's 128 contiguous bytes of a tap. Each thread works
out its rows' window corners once per tile (registers: the pixel offset, and the corner's y and
x packed in one word), so a k-slice costs a few adds and compares per copy. A 1x1, stride-1,
unpadded convolution of 16-bit x is a plain GEMM: x viewed as [pixels, channels] comes by TMA too.

In float32 a stage's row of 128 bytes holds 32 elements of K, which wgmma's k8 TF32 products
read (`sm90_engine.k_block`). The tensor cores would read float32 operands by dropping their low
13 bits, which makes each product smaller by about 2^-11 on average: through the 50 layers of
ResNet-50 the outputs drifted by 2e-2 where eager's TF32 is 8e-4 from float64. So float32 x is
always gathered, and each producer thread rounds its copies to TF32 (to nearest) once they land,
before it arrives on the slot (`cuda/conv_sm90.cuh`); constant weights come rounded by the
`allow_tf32` pass (`kiln.passes.tf32`). A float32 convolution without `allow_tf32` is declined
and computed in float32 elsewhere.

Declines (conv_tc takes over): groups other than 1 (conv_depthwise_nhwc's), channels not a
multiple of 8 (4 in float32), operands that are not plain loads (a fused prologue),
other dtypes, inputs of 2^31 elements or more.

Symbolic sizes (`Template.symbolic`): a symbolic batch (so M) is a kernel argument
(`HookedGemm.sizes`), the gathered rows bounded by it at run time; the window geometry is
written as numbers, so a symbolic height or width gives each size its own source.

The device code is the engine's (`cuda/sm90_engine.cuh`) and, where x is gathered,
`cuda/conv_sm90.cuh`'s `Gather` (a producer thread's rows and copies); this module gives the
engine's program the window geometry as enumerators and x as its member `x`. Knobs: `ConvKnobs`,
whose fields' defaults are the level-0 setting.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from kiln.template import CudaDialect, CudaProgram, Template, TensorMapArg, device_code, dtypes
from kiln_ops_builtin.templates import split_k
from kiln_ops_builtin.templates.conv_nhwc import ConvNHWC, match_conv_nhwc
from kiln_ops_builtin.templates.sm90_engine import BK, EngineKnobs, Problem, Producer, TmaLoad, k_block, program

PRODUCER_REGS = {4: 40, 8: 56, 16: 88}     # by rows gathered per producer thread

# The gathering producer's members of the engine's program: x, and its Gather (cuda/conv_sm90.cuh)
GATHER = """\
    static __device__ __forceinline__ const {t}* x(PARAMS) {{ return {x}; }}
    using Gather = kiln::conv_sm90::Gather<kiln_sm90_program>;
"""


@dataclass(frozen=True)
class ConvKnobs(EngineKnobs):
    """The engine's knobs (`sm90_engine.EngineKnobs`) a convolution takes: tiles of 64, 128 or
    256 rows (4, 8 or 16 gathered per producer thread), no clusters (the gathering producer
    cannot multicast) and no TMA stores. The defaults are level 0: 128 x 256 on two consumer
    warpgroups, 4 stages."""

    def producer_regs(self) -> int:
        """The producer warpgroup's registers where it gathers x: more for more rows a thread."""
        return PRODUCER_REGS[self.BM // 16]

    def valid(self) -> bool:
        return self.BM // 16 in PRODUCER_REGS and self.CLUSTER == 1 and not self.TMA_STORE and super().valid()

    @classmethod
    def space(cls, level: int) -> list[ConvKnobs]:
        """Level 0: 128 x 256 on two consumer warpgroups, 4 stages; level 1 adds the other tiles
        (N 64 to 256, 64 to 256 rows), ping-pong consumers and split-K; level 2 other depths."""
        if level == 0:
            return [cls()]
        out = [cls(**t.knobs) for t in FIT_TILES] + [PING_PONG, _k(64, 2, 1, 8, 1), PING_PONG_WIDE, _k(128, 2, 2, 4),
                                                      TALL, _k(64, 1, 1, 8, SPLIT=4)]
        if level == 2:
            out += [_k(256, 2, 1, 3), _k(128, 2, 1, 4), _k(64, 2, 1, 6), _k(128, 1, 1, 6), _k(128, 2, 2, 3),
                    _k(256, 1, 1, 4), _k(64, 1, 1, 8, SPLIT=8)]
        return out


_k = ConvKnobs.tile
DEFAULT = ConvKnobs()
PING_PONG = _k(128, 2, 1, 8, 1)
PING_PONG_WIDE = _k(256, 2, 1, 5, 1)
TALL = _k(64, 2, 2, 5)


def _producer(conv: ConvNHWC, bm: int, bn: int) -> Producer:
    K, kb = conv.kh * conv.kw * conv.channels, k_block(conv.dtype)
    weight = TensorMapArg(conv.weight, conv.dtype, (K, conv.out_channels), (1, K), (kb, bn))
    load_b = TmaLoad("B", weight, bn)
    if not _gathers(conv):
        x = TensorMapArg(conv.x, conv.dtype, (conv.channels, int(conv.gemm.M)), (1, conv.channels), (kb, bm))
        return Producer((TmaLoad("A", x, bm), load_b), (bm + bn) * BK * 2)
    geometry = {"H": conv.height, "W": conv.width, "C": conv.channels, "KW": conv.kw, "OH": conv.out_h,
                "OW": conv.out_w, "SH": conv.stride[0], "SW": conv.stride[1], "PH": conv.padding[0],
                "PW": conv.padding[1], "DH": conv.dilation[0], "DW": conv.dilation[1], "RPT": bm // 16,
                "EPC": _per_copy(conv.dtype), "TF32": int(conv.dtype == dtypes.float32)}
    members = GATHER.format(x=conv.x, t=CudaDialect().storage_type(conv.dtype))
    return Producer((load_b,), bn * BK * 2, threads=128, regs=PRODUCER_REGS[bm // 16], enums=geometry,
                    members=members, source=device_code(__package__, "cuda/conv_sm90.cuh"))


def _gathers(conv: ConvNHWC) -> bool:
    """Whether the producer threads gather x: for every window but a 1x1, stride-1, unpadded one
    (a GEMM, whose x comes by TMA), and for float32 x, which they round to TF32 as it lands."""
    return not conv.is_gemm or conv.dtype == dtypes.float32


def _per_copy(dtype) -> int:
    """Elements of x in one 16-byte copy: channels of one tap, so C must be a multiple."""
    return 16 // dtype.nbytes


FIT_TILES = [split_k.Tile(k.as_dict(), k.BM, k.BN, BK, 2048) for k in (
    DEFAULT, _k(128, 2, 1, 6), _k(64, 2, 1, 8), _k(128, 1, 1, 8), _k(256, 1, 1, 5), _k(64, 1, 1, 8))]
"""`suggest`'s cooperative tiles, at wgmma's 2048 float16 MACs per SM clock."""


def _even(k_tiles: int, split: int) -> int:
    """`split` lowered to the count whose parts are all non-empty at ceil(k_tiles / split) each."""
    return -(-k_tiles // -(-k_tiles // split))


def suggest(task, sm_count: int) -> list[dict]:
    """Knob settings for this convolution, best guess first, then `split_k.rank`'s ranking.
    The guess follows level-1 sweeps of ResNet-50's convolutions at batch 1 and 32 on an H200,
    by how many tiles each size makes against the SM count: N <= 64 takes 256 x 64 tiles from
    one wave, else 128 x 64 from 0.7 of one; wider N takes 64 x 256 ping-pong tiles from 1.5
    waves; K-heavy small grids (48+ k-tiles) 128 x 256 split over K when that fills 0.7 of a
    wave; then 256 x 128 for gathered K >= 1024, 128 x 128 ping-pong from a wave, cooperative 128 x 128
    and 64 x 128 from 0.7 of one. What is left takes 64 x 64 tiles, split over K up to a wave
    where the slices stay long (16+ k-tiles gathered, 24+ by TMA; at least 4 or 8 per split):
    a split costs a second kernel, which short reductions do not pay back. A symbolic batch
    counts as its bucket (`split_k.bucket` of M), so that the batches of a bucket share one
    source."""
    conv = match_conv_nhwc(task)
    M, N, K = (split_k.bucket(x) for x in (conv.gemm.M, conv.gemm.N, conv.gemm.K))
    ranked = split_k.rank(FIT_TILES, M, N, K, 1, sm_count, conv.dtype.nbytes)
    tiles = lambda bm, bn: -(-M // bm) * -(-N // bn)
    k_tiles = -(-K // k_block(conv.dtype))
    wide_split = min(sm_count // tiles(128, 256), k_tiles // 8)
    gathered = _gathers(conv)
    first = None
    if N <= 64:
        if tiles(256, 64) >= sm_count:
            first = TALL
        elif tiles(128, 64) >= 0.7 * sm_count:
            first = _k(64, 2, 1, 8)
    elif N > 128 and tiles(64, 256) >= 1.5 * sm_count:
        first = PING_PONG_WIDE
    elif N > 128 and k_tiles >= 48 and wide_split > 1 and tiles(128, 256) * wide_split >= 0.7 * sm_count:
        first = replace(DEFAULT, SPLIT=_even(k_tiles, wide_split))
    elif gathered and K >= 1024 and tiles(256, 128) >= 0.7 * sm_count:
        first = _k(128, 2, 2, 4)
    elif tiles(128, 128) >= sm_count:
        first = PING_PONG
    elif tiles(128, 128) >= 0.7 * sm_count:
        first = _k(128, 2, 1, 6)
    elif tiles(64, 128) >= 0.7 * sm_count:
        first = _k(128, 1, 1, 8)
    if first is None:
        first = _k(64, 1, 1, 8)
        if k_tiles >= (16 if gathered else 24):
            split = min(sm_count // tiles(64, 64), k_tiles // (4 if gathered else 8))
            if split > 1:
                first = replace(first, SPLIT=_even(k_tiles, split))
    return [first.as_dict()] + [k for k in ranked if k != first.as_dict()]


def applies(task) -> bool:
    conv = match_conv_nhwc(task)
    if conv is None:
        return False
    tf32 = conv.dtype == dtypes.float32 and bool(task.attrs.get("allow_tf32"))
    return (conv.groups == 1 and (conv.dtype in dtypes.HALF_FLOATS or tf32)
            and conv.channels % _per_copy(conv.dtype) == 0
            and conv.gemm.acc_dtype == dtypes.float32 and max(conv.height, conv.width) < 2 ** 15
            and (conv.batch + 1) * conv.height * conv.width * conv.channels < 2 ** 31
            and max(conv.gemm.M, conv.gemm.N * conv.gemm.K) < 2 ** 31)


def render(task, **knobs) -> CudaProgram:
    """The engine's program for `task` at the setting `knobs` (`ConvKnobs`' fields)."""
    conv = match_conv_nhwc(task)
    g, k = conv.gemm, ConvKnobs(**knobs)
    problem = Problem(g.M, g.N, g.K, 1, conv.dtype, g.params, g.args, g.hooks, g.sizes, g.sources, g.output)
    return program("kiln_conv_sm90", problem, _producer(conv, k.BM, k.BN), k)


TEMPLATE = Template("conv_sm90", ("conv2d_channels_last",), "cuda", render, priority=30, applies=applies,
                    space=ConvKnobs.settings, min_arch=90, suggest=suggest, symbolic=True)
