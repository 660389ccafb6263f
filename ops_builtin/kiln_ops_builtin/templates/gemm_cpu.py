"""GEMM-shaped tasks on the CPU in the BLIS style: matmul, batched matmul, linear and
convolution (implicit GEMM), float32 accumulation of float32/float16/bfloat16 operands.

The task is seen as batched GEMMs through the C hooks of `cpu_hooks` (so any operand strides,
transposes, 16-bit inputs and convolution windows are the hooks' business). The threads split N (or
M, where N has too few panels) in whole panels and never wait on each other: each cuts its share
into NC-wide, KC-deep and MC-tall blocks, packs a KC x NC block of B into NR-wide k-major panels
(along n a row of the whole block at a time, dealt out to the panels, or, where B is contiguous in
k, in runs along k transposed VW x VW in registers) and an MC x KC block of A into MR-tall panels,
both zero-padded to whole panels, and runs the register-blocked micro-kernel over the block's MR x
NR tiles (B panels outer, so a B panel stays in L1 while A's panels stream from L2, the next B
panel, where B was laid out once, prefetched into L2 meanwhile; A's panels outer for a
convolution's large planes: `render_conv`). Batches run one after another, or, where B was laid
out once and is larger than a batch's A (M < N: a convolution's small late planes, whose images
share its weight), inside each block of B, so that B is read into the caches once. The
micro-kernel, a function of its own (inlined into the block's loops, GCC runs out of registers for
the 14-row tile and spills), uses GCC vector extensions on the host's widest vectors (`cpu/simd.h`;
AVX-512: 14, 12 or 8 x 32 by M's last panel, AVX2: 6 x 16, else 128-bit 8 x 8; M's last panel, where
it has at most 4 rows and fewer than the tile, a tile of its own rows, whose padding rows the
full tile would compute: BERT's 128 rows are 22 panels of 6). A tile is added
into a float32 workspace (K blocks before the last; K up to WHOLE_K is one block) or handed to the
epilogue hook, which applies whatever fusion put there (bias, activation, residual, cast) and
stores.

A B that is one input, the same for every batch (a weight), may be laid out once when it is a
constant of the graph (`kiln.runtime.cpu.Preparation`): `kiln_prepare` packs all of its panels,
K deep, and `kiln_kernel_prepared` reads them in place of packing B per block.

With at most SMALL_M rows (grouped convolutions, vector-matrix products) nothing is packed:
rows of B are scaled into the accumulators, or, for B contiguous in k, dot products are taken;
B's panels laid out once are streamed once.

The device code is in `cpu/*.h`, C over compile-time knobs that the rendered program defines
as macros (`GemmKnobs`, the task's layout), in pieces that the convolution templates reuse
(`MICRO`, `BLOCK`): `simd.h` (vectors), `common.h`, `micro.h` (the micro-kernel; with A_DIRECT
1 it reads A in place as a convolution's taps, from the template's `kiln_a_rows`, each tap at a
fixed offset of the program), `gemm_hooks.h` (A's panels and finished tiles through the core's hooks,
where a convolution has its own), `gemm.h` (B's packing, the blocks of one thread, `kiln_gemm`:
the threads' split, reading B's panels from `bpre` where they were laid out once;
`kiln_pack_panels`, the layout) and `matmul.h` (the few-rows kernels and `kiln_main`); this
module renders the hooks' parameters, the knobs and the exported functions of `entry_points`.

Symbolic sizes are kernel arguments (`kiln.codegen.sizes`): BATCH, M, N and K are macros of
them, so one build serves every size.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, replace

from kiln.template import CpuProgram, KernelArgs, Knobs, Preparation, SymSize, Template, c_template_source, device_code

from kiln_ops_builtin.templates.cpu_hooks import calls_libm, gemm_form, match_cpu_gemm

# The device code (`cpu/*.h`) of the GEMM-shaped CPU templates, in its order: vectors, shared
# helpers and the micro-kernel; then A's side (the plain GEMM's `gemm_hooks.h`, or a template's
# own), the blocking and threads, and the template's kernel.
MICRO = ("cpu/simd.h", "cpu/common.h", "cpu/micro.h")
BLOCK = ("cpu/gemm.h",)
KERNEL = MICRO + ("cpu/gemm_hooks.h",) + BLOCK + ("cpu/matmul.h",)


@dataclass(frozen=True)
class GemmKnobs(Knobs):
    """The blocking: A's blocks MC rows tall, B's NC columns wide (whole panels of the widest
    vectors' 32), both KC deep, and K up to WHOLE_K one block (no float32 workspace between K
    blocks, which costs most where M x N outgrows the L2 cache); the register tile MR rows tall
    (at most 16; 0 takes the ISA's: `row_tile` of M with 16-float vectors, 6 with 8, 8 with 4); where A
    is read in place (`cpu/micro.h`'s A_DIRECT: a convolution's planes, whose consecutive rows of
    k lie a channel's plane apart, farther than the hardware prefetches), its row PREFETCH k ahead
    prefetched (0: none); with B_PREFETCH 1, B's next panel prefetched into L2 while a panel
    computes, where B is laid out once (`cpu/gemm.h`: a weight's panels come from memory)."""

    MC: int = 336
    KC: int = 256
    NC: int = 4096
    WHOLE_K: int = 768
    MR: int = 0
    PREFETCH: int = 16
    B_PREFETCH: int = 1

    def valid(self) -> bool:
        return (self.MC >= 16 and self.KC > 0 and self.NC > 0 and self.NC % 32 == 0 and self.WHOLE_K >= 0
                and 0 <= self.MR <= 16 and self.PREFETCH >= 0 and self.B_PREFETCH in (0, 1))

    @classmethod
    def space(cls, level: int) -> list[GemmKnobs]:
        """Level 0: the default blocking; higher levels add a shallower and a deeper K block."""
        return [cls()] + ([cls(KC=128), cls(KC=384, MC=224)] if level >= 1 else [])


WIDE_ROWS = (14, 12, 8)     # register-tile heights with 16-float vectors


def row_tile(m: int, heights=WIDE_ROWS) -> int:
    """The register-tile height for M = m rows: the one of `heights` that pads m's last panel
    least, the tallest of those tied (M = 128 takes 8: 14 would compute 140 rows)."""
    return min(heights, key=lambda r: (-(-m // r) * r - m, -r))


def applies(task) -> bool:
    """Sums of products with at least one term (an empty sum, K = 0, is the auto-scheduler's);
    decided without rendering the hooks (`gemm_form`)."""
    g = gemm_form(task)
    return g is not None and g.K > 0


def render(task, **knobs) -> CpuProgram:
    """The program `kiln_kernel(inputs..., output)` for `task` at the setting `knobs`
    (`GemmKnobs`' fields)."""
    return _render(task, GemmKnobs(**knobs), planes=False)


L2_BYTES = 2 << 20          # the L2 cache the blocking below assumes (this project's CPUs': 2 MiB)
ROWS_OUTER_PIXELS = 512     # the least plane (output pixels) that `render_conv` writes with A's panels outer
ROWS_OUTER_BLOCK = L2_BYTES // 8  # B's block then, in floats: half of L2


def render_conv(task, **knobs) -> CpuProgram:
    """`render` for a convolution, whose rows are output channels (NCHW), each a plane of pixels
    along the columns: where the planes have at least ROWS_OUTER_PIXELS pixels, A's panels outer
    (`cpu/gemm.h`'s ROWS_OUTER), so that a tile's channels are written as long runs along their
    planes (B's panels outer write a short piece of every channel's plane per panel: more
    streams than the hardware prefetches), with B's blocks cut to ROWS_OUTER_BLOCK floats to stay
    in L2 while A's panels sweep them."""
    return _render(task, GemmKnobs(**knobs), planes=True)


def _render(task, k: GemmKnobs, planes: bool) -> CpuProgram:
    """The program of `task` at `k`; with `planes` (a convolution's), A's panels outer where its
    planes are large (`render_conv`)."""
    g = match_cpu_gemm(task)
    if g is None:
        raise ValueError(f"gemm_cpu does not apply to task '{task.name}'")
    g = replace(g, sizes=copy.deepcopy(g.sizes))      # the match is shared: `text` may add sizes
    extents = {name: g.text(value) for name, value in (("BATCH", g.batch), ("M", g.M), ("N", g.N), ("K", g.K))}
    fixed = lambda size: not isinstance(size, SymSize)        # a symbolic size's choice would differ by size
    rows_outer = planes and fixed(g.N) and g.N >= ROWS_OUTER_PIXELS
    args, sizes, size_args = KernelArgs.args(len(task.inputs)), g.sizes.declarations(), g.sizes.names
    blocks = block_knobs(k, g.K if fixed(g.K) else None)
    if rows_outer:
        blocks["NC"] = max(32, min(k.NC, ROWS_OUTER_BLOCK // blocks["KC"] // 32 * 32))
    defines = {"PARAMS": ", ".join(g.buffers + [BPRE] + sizes), "ARGS": ", ".join(args + ["bpre"] + size_args),
               **extents, **blocks, "MR_WIDE": row_tile(g.M) if fixed(g.M) else WIDE_ROWS[0], "A_DIRECT": 0,
               "B_BY_K": int(g.b_by_k), "B_GROUPS": 1, "ROWS_OUTER": int(rows_outer), "EPILOGUE_LIBM": int(calls_libm(task))}
    entries = entry_points(g.buffers, args, sizes, size_args, "kiln_main", "kiln_pack_panels")
    return CpuProgram(c_template_source([device_code(__package__, *KERNEL), entries], defines, g.hooks),
                      "kiln_kernel", tuple(args), sizes=g.sizes.values,
                      preparation=preparation(g.b_input, len(task.inputs)))


def block_knobs(k: GemmKnobs, depth: int | None) -> dict:
    """`k` as the macros of `cpu/micro.h` and `cpu/gemm.h` (MC, KC, NC, MR_KNOB, A_PREFETCH, B_PREFETCH)
    for a GEMM of reduction length `depth` (None where it is symbolic: KC then stays the knob's)."""
    return {"MC": k.MC, "KC": depth if depth is not None and depth <= k.WHOLE_K else k.KC, "NC": k.NC,
            "MR_KNOB": k.MR, "A_PREFETCH": k.PREFETCH, "B_PREFETCH": k.B_PREFETCH}


BPRE = "const float* __restrict__ bpre"


def entry_points(buffers: list[str], args: list[str], sizes: list[str], size_args: list[str], main: str,
                 prepare: str) -> str:
    """C of a GEMM program's exported functions (buffer parameters `buffers` named `args`, size
    parameters `sizes` named `size_args`) around `main(<buffers>, bpre, <sizes>)`, the kernel,
    which reads B's panels laid out once from bpre or packs them itself where bpre is NULL, and
    `prepare(<buffers>, bpre, <sizes>, dst)`, which lays them out (`kiln_pack_panels`):
    `kiln_kernel` (bpre NULL), `kiln_kernel_prepared` (bpre after the buffers) and
    `kiln_prepare` (see `preparation`)."""
    plain = ", ".join(buffers + sizes)
    call = lambda bpre: ", ".join(args + [bpre] + size_args)
    return (f"void kiln_kernel({plain}) {{ {main}({call('NULL')}); }}\n"
            f"void kiln_kernel_prepared({', '.join(buffers + [BPRE] + sizes)}) {{ {main}({call('bpre')}); }}\n"
            f"int64_t kiln_prepare({plain}, float* dst) {{ return {prepare}({call('NULL')}, dst); }}\n")


def preparation(b_input: int | None, inputs: int) -> Preparation | None:
    """How a program of `entry_points` with `inputs` inputs lays out input `b_input`, its B,
    where that is a constant (None: no input may be)."""
    if b_input is None:
        return None
    return Preparation(b_input, "kiln_prepare", "kiln_kernel_prepared",
                       (*KernelArgs.args(inputs), KernelArgs.input(inputs)))


MATMUL = Template("gemm_cpu", ("matmul", "linear", "dft"), "cpu", render, priority=10, applies=applies,
                  space=GemmKnobs.settings, symbolic=True)
CONV = Template("conv_gemm_cpu", ("conv1d", "conv2d"), "cpu", render_conv, priority=10, applies=applies,
                space=GemmKnobs.settings, symbolic=True)
