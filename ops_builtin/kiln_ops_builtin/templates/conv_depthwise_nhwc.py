"""Depthwise and grouped conv2d on channels-last data: `conv2d_channels_last` with groups > 1,
as many output channels as input channels and G = channels / groups of them per group (1 for a
depthwise convolution; G must divide the vector width), float16, bfloat16 or float32.

A block computes a tile of TH output rows x TW = TX * PX columns x CB channels of one image. It
first copies the input window the tile reads into shared memory (zero outside the image, so
padding costs no test later), in V-channel packs (16 bytes of input: eight 16-bit channels,
four float32 ones): consecutive threads copy consecutive packs of a pixel, then the next
pixel, so a warp reads whole lines, each thread FILL packs at once (their loads issued before
any store); then the block's filters. A 16-byte pack of a 16-bit type is stored as it is (half
the shared memory of float32, so more blocks an SM), anything else as float32
(`stored_bytes`). Each of the block's (CB / V) * TX * TH threads computes PX neighbouring
output pixels of one row for V channels, accumulating in float32 registers: for each filter
row it reads the NWIN input packs under its PX outputs from shared memory into registers once
(as float32), and each tap of the row takes its PX packs from those (rather than reading them
again, up to KW times a pack), with the V * G weights of the tap. Outputs go through the
core's vector epilogue hook (`kiln_epilogue_v`: GEMM row m the output pixel, column n the
channel), one pack per pixel, so bias, folded batch norm, activations and residual adds fuse
in, read as packs too.

Shared memory holds a pack as quads of QW stored values (16 bytes at most: `quad_width`),
quad h of every pack of a pixel before quad h + 1, so that neighbouring threads (neighbouring
packs) read neighbouring 16 bytes; each pixel is padded to the size that leaves the fewest
bank conflicts for the block's threads, which read pixels PX * stride apart (`_pixel_values`).

The input comes from DRAM once (the windows of neighbouring tiles overlap by the filter's
halo, read again from L2) and each output is written once. Where the channels are not a
multiple of 8 (16-bit) or 4 (float32), V is the largest power of two that divides them (and
that G divides).

Declines: kernels over MAX_KERNEL, strides other than 1 and 2, a channel multiplier (more output
than input channels), G that divides no vector width, float64, an epilogue that permutes the
output (its innermost index must be the channel), operands that are not plain loads.

Symbolic sizes (`Template.symbolic`): the kernel never reads the batch (the grid covers it), so
a symbolic batch keeps one source, any size the epilogue reads being a kernel argument
(`kiln.codegen.sizes.SizeArgs.of(task)`); the geometry is written as numbers, so a symbolic
height or width gives each size its own source.

The device code is `cuda/conv_depthwise_nhwc_kernel.cuh` (the kernel), on `cuda/conv_depthwise.cuh`'s
`kiln::conv_depthwise::PackTile` (the knobs, fitted) and `Shape` (the convolution, conv_depthwise's
too); between the two this module renders `kiln_conv_depthwise_nhwc_program`: the knobs, the
shape, the input's and the window's types and how the input and the filter are read. Knobs:
`DepthwiseNHWCKnobs`.
"""
from __future__ import annotations

from dataclasses import dataclass

from kiln.template import (CudaDialect, CudaProgram, KernelArgs, Knobs, Launch, SizeArgs, Template, as_dim, device_code,
                           dtypes, inline_task, render_vector_epilogue, template_source, top_reduces, unravel_index,
                           vector_stores)
from kiln_ops_builtin.templates.conv_nhwc import ConvNHWC, match_conv_nhwc
from kiln_ops_builtin.templates.split_k import bucket

PACK_BYTES = 16
MAX_KERNEL = 7
MAX_THREADS = 512
SMEM_LIMIT = 96 * 1024        # bytes of shared memory a block may take (two blocks fit an SM)
SMALL_GRID_WARPS = 4
LARGE_GRID_WARPS = 24
FILL = 4                      # input packs a thread loads at once while filling shared memory

# What cuda/conv_depthwise_nhwc_kernel.cuh's kernel reads of a program: the fitted knobs
# (kiln::conv_depthwise::PackTile), the convolution (Shape), the input's and the window's types,
# the input parameter, an element of the filter and how an element of them is read.
PROGRAM = """
struct kiln_conv_depthwise_nhwc_program {{
    using Tile = kiln::conv_depthwise::PackTile<{cb}, {v}, {g}, {px}, {tx}, {th}, {pix}, {fill}>;
    using Shape = kiln::conv_depthwise::Shape<{c}, {h}, {w}, {oh}, {ow}, {kh}, {kw}, {sh}, {sw}, {ph}, {pw}, {dh},
                                              {dw}>;
    using T = {t};
    using S = {s};
    static __device__ __forceinline__ auto x({params}) {{ return {x}; }}
    static __device__ __forceinline__ auto w({params}, int64_t i) {{ return {wt}[i]; }}
    template <typename V>
    static __device__ __forceinline__ auto load(V v) {{ return {load}; }}
    template <typename V>
    static __device__ __forceinline__ auto store_s(V v) {{ return {store_s}; }}
    template <typename V>
    static __device__ __forceinline__ auto load_s(V v) {{ return {load_s}; }}
}};
"""


@dataclass(frozen=True)
class DepthwiseNHWCKnobs(Knobs):
    """Tiles of CB channels x TH rows x TX strips of PX pixels (`_fit` clamps them to the
    convolution and shrinks them to fit a block)."""

    CB: int = 32
    PX: int = 2
    TX: int = 4
    TH: int = 8

    def valid(self) -> bool:
        return min(self.CB, self.PX, self.TX, self.TH) >= 1

    @classmethod
    def space(cls, level: int) -> list[DepthwiseNHWCKnobs]:
        """Level 0: 32 channels x 8 rows x 8 columns (2 pixels a thread; `suggest` fits a first
        choice to the convolution instead); level 1 adds `suggest`'s other guesses, narrower and
        wider rows, fewer and more pixels a thread, more and fewer channels; level 2 a grid of them."""
        out = [cls()]
        if level >= 1:
            out += [SMALL, STRIDED, cls(64, 4, 4, 4), cls(64, 2, 8, 2), cls(32, 4, 2, 8), cls(64, 8, 2, 4),
                    cls(32, 1, 8, 8), cls(32, 2, 8, 4), cls(16, 2, 4, 8)]
        if level >= 2:
            grid = [cls(cb, px, tx, th) for cb in (16, 32, 64) for px in (1, 2, 4, 8)
                    for tx, th in ((2, 2), (4, 4), (8, 2), (2, 8))]
            out += [k for k in grid if k not in out]
        return out


SMALL = DepthwiseNHWCKnobs(CB=16, PX=1, TX=4, TH=4)      # small grids
STRIDED = DepthwiseNHWCKnobs(CB=128, PX=4, TX=2, TH=8)   # large 3x3 stride-2 convolutions (CB: all channels)


def vector_width(conv: ConvNHWC) -> int | None:
    """Channels per pack: the most that fit 16 bytes, divide the channels and are a multiple of
    G (the channels of a group); None where none is."""
    group = conv.channels // conv.groups
    return next((v for v in (8, 4, 2, 1) if v * conv.dtype.nbytes <= PACK_BYTES and conv.channels % v == 0
                 and v % group == 0), None)


def _epilogue_index(out):
    """`index_of` for the epilogue hooks: GEMM row m the output pixel, column n the channel."""
    def index_of(bvar, mvar, nvar):
        return {**unravel_index(mvar, out.axes[:3], out.shape[:3]), id(out.axes[3]): nvar}
    return index_of


def _extents(conv: ConvNHWC) -> tuple[int, int, int]:
    return 1, conv.batch * conv.out_h * conv.out_w, conv.channels


def applies(task) -> bool:
    conv = match_conv_nhwc(task)
    if (conv is None or conv.groups == 1 or conv.out_channels != conv.channels or not conv.channels_innermost
            or conv.dtype not in (dtypes.float16, dtypes.bfloat16, dtypes.float32) or vector_width(conv) is None
            or max(conv.kh, conv.kw) > MAX_KERNEL or not set(conv.stride) <= {1, 2}
            or top_reduces(inline_task(task).outputs[0].value)[0].dtype != dtypes.float32
            or conv.batch * conv.height * conv.width * conv.channels >= 2 ** 31):
        return False
    out = inline_task(task).outputs[0]
    return (vector_stores(out, _epilogue_index(out), vector_width(conv), _extents(conv))
            and _fit(conv, **DepthwiseNHWCKnobs().as_dict()) is not None)


def stored_bytes(conv: ConvNHWC) -> int:
    """Bytes of an input value in shared memory: its own 16-bit type where a pack is 16 bytes
    (half the shared memory, so more blocks an SM), else float32."""
    return 2 if conv.dtype.nbytes == 2 and vector_width(conv) * 2 == PACK_BYTES else 4


def quad_width(conv: ConvNHWC) -> int:
    """Stored values per shared-memory access (QW): 16 bytes' worth, at most a pack."""
    return min(vector_width(conv), PACK_BYTES // stored_bytes(conv))


def _tile(conv: ConvNHWC, CB, PX, TX, TH) -> dict:
    """The tile's derived sizes: channel packs per block, columns, input window, threads, the
    window's stored values per pixel, shared memory bytes."""
    v, group = vector_width(conv), conv.channels // conv.groups
    ih = (TH - 1) * conv.stride[0] + (conv.kh - 1) * conv.dilation[0] + 1
    iw = (TX * PX - 1) * conv.stride[1] + (conv.kw - 1) * conv.dilation[1] + 1
    tile = {"CBV": CB // v, "TW": TX * PX, "IH_T": ih, "IW_T": iw, "NT": CB // v * TX * TH}
    tile["PIX"] = _pixel_values(conv, CB, PX, TX, tile)
    return {**tile, "smem": ih * iw * tile["PIX"] * stored_bytes(conv) + conv.kh * conv.kw * CB * group * 4}


def _pixel_values(conv: ConvNHWC, CB: int, PX: int, TX: int, tile: dict) -> int:
    """Stored values a pixel of the input window takes in shared memory: its CB channels and
    the padding (up to a bank row) that leaves the fewest bank conflicts where the block's
    threads read it (a warp's accesses of QW values go in 128 bytes / (QW values) lanes at a
    time; lanes of one channel pack read the same pixel, those of the next strip or row pixels
    PX * SW or a row apart)."""
    qw = quad_width(conv)
    slots = 128 // (qw * stored_bytes(conv))

    def cost(pix: int) -> int:
        total = 0
        for first in range(0, tile["NT"], slots):
            found: dict[int, set] = {}
            for t in range(first, min(first + slots, tile["NT"])):
                cv, strip, row = t % tile["CBV"], t // tile["CBV"] % TX, t // (tile["CBV"] * TX)
                unit = ((row * conv.stride[0] * tile["IW_T"] + strip * PX * conv.stride[1]) * pix) // qw + cv
                found.setdefault(unit % slots, set()).add(unit)
            total += max(map(len, found.values()))
        return total

    return min((CB + pad * qw for pad in range(slots)), key=lambda pix: (cost(pix), pix))


def _fit(conv: ConvNHWC, CB, PX, TX, TH) -> dict | None:
    """The knobs clamped to the convolution (no more channels, columns or rows than it has) and
    shrunk until the block fits MAX_THREADS and SMEM_LIMIT (rows first, then columns, pixels
    per thread, channels); None where nothing fits."""
    v = vector_width(conv)
    if CB < 1 or PX < 1 or TX < 1 or TH < 1:
        raise ValueError(f"invalid conv_depthwise_nhwc knobs CB={CB}, PX={PX}, TX={TX}, TH={TH}")
    CB = max(v, min(CB, conv.channels) // v * v)
    PX = min(PX, conv.out_w)
    TX, TH = min(TX, -(-conv.out_w // PX)), min(TH, conv.out_h)
    while True:
        tile = _tile(conv, CB, PX, TX, TH)
        if tile["NT"] <= MAX_THREADS and tile["smem"] <= SMEM_LIMIT:
            return {"CB": CB, "PX": PX, "TX": TX, "TH": TH, **tile}
        if TH > 1:
            TH = -(-TH // 2)
        elif TX > 1:
            TX = -(-TX // 2)
        elif PX > 1:
            PX //= 2
        elif CB > v:
            CB = max(v, CB // 2 // v * v)
        else:
            return None


def suggest(task, sm_count: int) -> list[dict]:
    """Knob settings for this convolution, best guess first, then level 1's. The guess goes by
    the grid's size in warps an SM (a thread per output pixel's channel pack): under
    SMALL_GRID_WARPS, `SMALL` tiles of a pixel a thread (latency wants threads more than
    reuse); from LARGE_GRID_WARPS, a 3x3 stride-2 convolution of at most 128 channels takes
    `STRIDED` tiles of every channel (its input, four times its output, dominates the
    traffic); anything else the defaults. Fitted on an H100 to 140 settings timed on each shape of
    `conv_bench.py --suite depthwise` at batch 1 and 8 (`benchmarks/depthwise_grid.py`,
    2026-11-26): the guess reached 0.955 of each shape's best in geomean (the rule before it
    0.860), no shape under 0.9 of cuDNN (0.75 before). A symbolic batch counts as its bucket
    (`split_k.bucket`), so that the batches of a bucket share one source."""
    conv = match_conv_nhwc(task)
    packs = bucket(conv.batch) * conv.out_h * conv.out_w * -(-conv.channels // vector_width(conv))
    warps = packs / (32 * sm_count)
    if warps < SMALL_GRID_WARPS:
        first = SMALL.as_dict()
    elif (warps >= LARGE_GRID_WARPS and conv.stride == (2, 2) and (conv.kh, conv.kw) == (3, 3)
          and conv.channels <= 128):
        first = dict(STRIDED.as_dict(), CB=conv.channels)
    else:
        first = DepthwiseNHWCKnobs().as_dict()
    fitted = _fit(conv, **first)
    first = {k: fitted[k] for k in first}
    return [first] + [k for k in DepthwiseNHWCKnobs.settings(1) if k != first]


def render(task, **knobs) -> CudaProgram:
    """The program of `task` at the setting `knobs` (`DepthwiseNHWCKnobs`' fields), fitted (`_fit`)."""
    conv = match_conv_nhwc(task)
    k = _fit(conv, **DepthwiseNHWCKnobs(**knobs).as_dict())
    v, d = vector_width(conv), CudaDialect()
    lowered = inline_task(task)
    out = lowered.outputs[0]
    sizes = SizeArgs.of(task)
    decl = KernelArgs.params(d, lowered.inputs, [out]) + sizes.declarations()
    args = KernelArgs.args(len(lowered.inputs)) + sizes.names
    epilogue = render_vector_epilogue(lowered, out, decl, _epilogue_index(out), v, _extents(conv), sizes)
    tiles_y, tiles_x = -(-conv.out_h // k["TH"]), -(-conv.out_w // k["TW"])
    raw = stored_bytes(conv) == conv.dtype.nbytes      # the window keeps the input's own type
    load = d.load(conv.dtype, "(v)")
    program = PROGRAM.format(cb=k["CB"], v=v, g=conv.channels // conv.groups, px=k["PX"], tx=k["TX"], th=k["TH"],
                             pix=k["PIX"], fill=FILL, c=conv.channels, h=conv.height, w=conv.width, oh=conv.out_h,
                             ow=conv.out_w, kh=conv.kh, kw=conv.kw, sh=conv.stride[0], sw=conv.stride[1],
                             ph=conv.padding[0], pw=conv.padding[1], dh=conv.dilation[0], dw=conv.dilation[1],
                             t=d.storage_type(conv.dtype), s=d.storage_type(conv.dtype) if raw else "float",
                             params=", ".join(decl), x=conv.x, wt=conv.weight, load=load,
                             store_s="(v)" if raw else load, load_s=load if raw else "(v)")
    # the epilogue hook's (the kernel reads them too)
    defines = {"PARAMS": ", ".join(decl), "ARGS": ", ".join(args)}
    grid = (as_dim(conv.batch * tiles_y * tiles_x) * -(-conv.channels // k["CB"]), 1, 1)
    launch = Launch("kiln_conv_depthwise_nhwc", tuple(args), (k["NT"], 1, 1), grid=grid, smem=k["smem"])
    kernels = [device_code(__package__, "cuda/conv_depthwise.cuh"), program,
               device_code(__package__, "cuda/conv_depthwise_nhwc_kernel.cuh")]
    return CudaProgram(template_source(kernels, defines, epilogue), [launch], alignment=PACK_BYTES,
                       sizes=sizes.values)


TEMPLATE = Template("conv_depthwise_nhwc", ("conv2d_channels_last",), "cuda", render, priority=20, applies=applies,
                    space=DepthwiseNHWCKnobs.settings, suggest=suggest, symbolic=True)
