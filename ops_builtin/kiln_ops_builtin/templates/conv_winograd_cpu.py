"""3x3 convolutions of stride 1 on the CPU by Winograd's minimal filtering F(2x2, 3x3) (Lavin and
Gray, 2015): each 2 x 2 block of output pixels (a *tile*) of each output channel takes 16
multiplications per input channel instead of 36.

With d the tile's 4 x 4 input patch (per input channel) and g the 3 x 3 kernel, Y = A^T [(G g
G^T) . (B^T d B)] A, where the products of the 16 positions (.) summed over input channels are
16 GEMMs, M[p] = V[p] U[p] (tiles x input channels times input channels x output channels), on
`gemm_cpu`'s micro-kernel:

- U = G g G^T is the weight's transform, laid out as `gemm_cpu`'s B panels per position; a
  constant weight is transformed once (`gemm_cpu.preparation`), another one at each call;
- V = B^T d B is made per block of MR tiles, vectorized across the tiles of each of its
  segments (the block's tiles within one tile row), from the input copied into two zero-padded
  phase planes per channel (`cpu/planes.h` with strides (1, 2): even and odd columns apart, so
  that each of a tile's four patch columns is one unaligned vector load over consecutive
  tiles); a chunk of blocks' A panels (per position, input channels x MR tiles) made ahead of
  their products stay in the L2 cache (`CHUNK_BYTES`);
- per panel of NR output channels and block of the chunk, the 16 micro-kernel products go to a
  buffer, the output transform runs on vectors of channels, each of the four outputs of a tile
  is transposed to vectors of tiles in registers, and a channel's two pixel columns are
  interleaved into runs of an output row, segment by segment, for the epilogue hook (bias,
  folded batch norm, activation, residual: what fusion put there).

A block is MR consecutive tiles of all the images' tiles, flat over (image, tile row, tile), so
that blocks compute no tiles past a row's end where MR does not divide a row's tile count (on
AVX2, 6-tile blocks on ResNet's 14 x 14 layers, 7 tiles a row, computed 12 a row: the step took
1.55x the time); only the last block may end past the last tile. F(2x2, 3x3)'s transforms
only add, subtract and halve, so its results stay within a few float32 roundings of the direct
sum's. The template takes 3x3 convolutions of stride 1 and dilation 1 with 16 input and output
channels or more and at least `MIN_TILES` tiles, all images' together; fixed sizes, as
`conv_cpu`.
"""
from __future__ import annotations

from kiln.template import CpuProgram, Template

from kiln_ops_builtin.templates import gemm_cpu
from kiln_ops_builtin.templates.conv_cpu import ALIGNED_ROWS, match_conv, prepared_program

KERNEL = gemm_cpu.MICRO + ("cpu/planes.h", "cpu/winograd.h")     # the device code (`cpu/*.h`)

# Per output channel and input channel, the transform saves about 20 * tiles / 16 vector
# multiplications and writes 16 floats of U (per call where the weight is not a constant; 16/9
# of the weight's memory): below ~48 tiles that costs more than it saves (512 channels at 12 x 12,
# 36 tiles: 1.25x slower than conv_cpu transforming per call, 1.06x faster laid out once; at
# 14 x 14, 49 tiles: 1.4x / 2.1x faster; at 56 x 56: 1.8x). The tiles of a batch's images count
# together: blocks span images (ResNet-50 b8's 512 channels at 7 x 7, 8 x 16 tiles, the weight
# laid out once: 22 -> 14 ms a step, 1 thread, AVX2).
MIN_TILES = 48

# The V of a chunk of blocks (`cpu/winograd.h`'s CHUNK_BYTES), made ahead of the products that
# read it once per panel of output channels: what stays in L2 with the panel's U beside it; but
# all of a thread's blocks where U is the larger (more output channels than tiles: ResNet-50 b8's
# 512 channels at 7 x 7, 128 tiles, whose U of 16 MB read once per chunk of 3 blocks made the
# step 19 ms against 14 ms for all 22 blocks at once; 1 thread, AVX2).
CHUNK_BYTES = 1 << 20


def applies(task) -> bool:
    c = match_conv(task)
    return (c is not None and c.groups == 1 and c.kernel == (3, 3) and c.stride == (1, 1) and c.dilation == (1, 1)
            and min(c.x.shape[1], c.out_shape[1]) >= 16
            and c.out_shape[0] * -(-c.out_shape[2] // 2) * -(-c.out_shape[3] // 2) >= MIN_TILES)


def render(task) -> CpuProgram:
    """The program `kiln_kernel(inputs..., output)` for `task`, and `kiln_kernel_prepared` for its
    weight transformed once."""
    c = match_conv(task)
    if c is None or not applies(task):
        raise ValueError(f"conv_winograd_cpu does not apply to task '{task.name}'")
    tiles_w = -(-c.out_shape[3] // 2)
    mr = next((r for r in ALIGNED_ROWS if tiles_w % r == 0), gemm_cpu.row_tile(tiles_w))
    hq, wq = 2 * -(-c.out_shape[2] // 2) + 2, tiles_w + 2
    tiles = c.out_shape[0] * -(-c.out_shape[2] // 2) * tiles_w
    defines = {"PARAMS": "TASK_PARAMS", "ARGS": "TASK_ARGS", "SH": 1, "SW": 2, "HQ": hq, "WQ": wq,
               "CHUNK_BYTES": 0 if c.out_shape[1] > tiles else CHUNK_BYTES,
               "PLANE": c.x.shape[1] * 2 * hq * wq + 32, "COUT": c.out_shape[1], "MR_WIDE": mr, "MR_KNOB": 0, "MC": mr,
               "A_DIRECT": 0}
    return prepared_program(c, defines, KERNEL, "kiln_wino", "kiln_wino_prepare")


TEMPLATE = Template("conv_winograd_cpu", ("conv2d",), "cpu", render, priority=25, applies=applies,
                    fixed_sizes_only=True)
