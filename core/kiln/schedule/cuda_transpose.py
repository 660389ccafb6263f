"""The auto-scheduler's transpose rule: element-wise tasks that read a tensor across its rows.

A permute that moves the innermost dim (a [M, N] matrix to [N, M], NCHW to NHWC), alone or with
element-wise work fused around it, writes its output along one dim and reads its input along
another. A kernel that walks the output in order makes each warp's loads touch 32 rows of the
input, 32 sectors for 32 elements. Here a block takes a TILE x TILE tile of the output over its
innermost dim `b` and the dim `a` that the input's innermost index is: its threads compute the
tile's values with consecutive lanes along `a` (the input read in order), keep them in shared
memory, and write them with consecutive lanes along `b` (the output written in order). Every
other output dim is a tile row of the grid.

Applies to a task of one output buffer, no reduction, fixed sizes, whose value loads a tensor
at its own innermost index equal to output dim `a` (not the innermost) and not depending on
output dim `b`, with `a` and `b` at least TILE long. It goes before the row rule.
"""
from __future__ import annotations

import math

from kiln.codegen.cuda import CudaDialect
from kiln.ir.expr import Load, Var, top_reduces, walk
from kiln.ir.inline import Lowered
from kiln.ir.size import SymSize
from kiln.runtime.cuda import CudaProgram, Launch
from kiln.schedule.cuda_kernels import AutoProgram, CudaEmitter, at_item, signature

TILE = 32
ROWS = 8                  # warps of a block: each thread takes TILE / ROWS elements of the tile
MAX_GRID_Y = 65535


def transposed_dim(lowered: Lowered) -> int | None:
    """The output dim `a` whose index is a loaded tensor's innermost one, where `lowered` is a
    transpose (see the module doc); None otherwise."""
    if len(lowered.buffers) != 1 or len(lowered.outputs) != 1:
        return None
    buf = lowered.buffers[0]
    shape = buf.shape
    if (len(shape) < 2 or any(isinstance(s, SymSize) for s in shape) or top_reduces(buf.value)
            or shape[-1] < TILE):
        return None
    inner = buf.axes[-1]
    for x in walk(buf.value):
        if not isinstance(x, Load) or not x.indices:
            continue
        last = x.indices[-1]
        if isinstance(last, Var) and last is not inner and not any(v is inner for v in walk(last)):
            a = next((k for k, axis in enumerate(buf.axes[:-1]) if axis is last), None)
            if a is not None and shape[a] >= TILE and -(-shape[a] // TILE) <= MAX_GRID_Y:
                return a
    return None


def schedule(lowered: Lowered) -> CudaProgram | None:
    """The tiled-transpose program of `lowered`; None where it is not a transpose."""
    a = transposed_dim(lowered)
    if a is None:
        return None
    auto = AutoProgram(lowered)
    buf = lowered.buffers[0]
    out = auto.names[id(buf)]
    d = CudaDialect()
    shape = [int(s) for s in buf.shape]
    b = len(shape) - 1
    strides = [math.prod(shape[k + 1:]) for k in range(len(shape))]
    rest = [k for k in range(len(shape)) if k not in (a, b)]
    rest_count = math.prod(shape[k] for k in rest)
    # the output offset of tile row `r` (the other dims, row-major)
    base, inner = [], 1
    for k in reversed(rest):
        base.append(f"((kt_r / {inner}) % {shape[k]}) * {strides[k]}")
        inner *= shape[k]
    base_text = " + ".join(base) or "0"
    value, names = at_item(buf, buf.value, auto.names)
    em = CudaEmitter(d, names, auto.strides, "thread", indent=4, sizes=auto.sizes)
    v = em.emit(value)
    element = "\n".join(em.lines)
    st = d.storage_type(buf.dtype)
    args = auto.available + [(out, buf, False)]
    source = f"""extern "C" __global__ void __launch_bounds__({TILE * ROWS}) kiln_transpose({signature(d, args)}) {{
    __shared__ {st} kt_tile[{TILE}][{TILE + 1}];
    const int kt_x = threadIdx.x % {TILE}, kt_y = threadIdx.x / {TILE};
    const int64_t kt_b0 = (int64_t)blockIdx.x * {TILE}, kt_a0 = (int64_t)blockIdx.y * {TILE};
    for (int64_t kt_r = blockIdx.z; kt_r < {rest_count}; kt_r += gridDim.z) {{
        const int64_t kt_row = {base_text};
        for (int kt_k = kt_y; kt_k < {TILE}; kt_k += {ROWS}) {{
            if (kt_a0 + kt_x < {shape[a]} && kt_b0 + kt_k < {shape[b]}) {{
                const int64_t o = kt_row + (kt_a0 + kt_x) * {strides[a]} + kt_b0 + kt_k;
{element}
                kt_tile[kt_k][kt_x] = {d.store(buf.dtype, v)};
            }}
        }}
        __syncthreads();
        for (int kt_k = kt_y; kt_k < {TILE}; kt_k += {ROWS}) {{
            if (kt_a0 + kt_k < {shape[a]} && kt_b0 + kt_x < {shape[b]})
                {out}[kt_row + (kt_a0 + kt_k) * {strides[a]} + kt_b0 + kt_x] = kt_tile[kt_x][kt_k];
        }}
        __syncthreads();
    }}
}}
"""
    grid = (-(-shape[b] // TILE), -(-shape[a] // TILE), min(rest_count, 65535))
    launch = Launch("kiln_transpose", tuple(n for n, _, _ in args), (TILE * ROWS, 1, 1), grid=grid)
    return CudaProgram(d.prelude + "\n" + source, [launch], auto.temporaries, sizes=auto.sizes.values)
