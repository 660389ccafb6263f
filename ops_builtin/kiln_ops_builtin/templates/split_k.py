"""Split-K for the contraction templates: SPLIT blocks share each output tile's K range.

A template kernel launched on a grid (tiles, SPLIT, batch) walks only the k-tiles of its split,

    const int KT0 = blockIdx.y * KT_SPLIT, KT = min((K + BK - 1) / BK - KT0, KT_SPLIT);

(k-tiles KT0 .. KT0 + KT - 1; split boundaries are whole k-tiles, so bounds checks against K stay
exact) and hands each finished accumulator to `KILN_STORE(b, m, n, v)` or
`KILN_STORE2(b, m, n, v0, v1)` (n even, n + 1 < N). With SPLIT = 1 these are the core's
epilogue hooks. With SPLIT > 1 they write float32 partials to a workspace temporary
[SPLIT][batch][M][N], and a second kernel, `kiln_split_k_sum`, adds the SPLIT partials of each
element in a fixed order (deterministic, no atomics) and applies the epilogue hooks, so
fusion works the same either way.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kiln import dtypes
from kiln.schedule.cuda_program import Launch

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


def plan(split: int, M: int, N: int, K: int, BK: int, batch: int, params: str, args: tuple[str, ...],
         temporaries: list, split_index: str = "blockIdx.y") -> SplitK:
    """Split-K over `split` parts for a template computing a batch x M x N GEMM with k-tiles of
    BK; `params`/`args` are the epilogue hooks' parameters and arguments. The workspace is
    appended to `temporaries` (the program's list). `split_index` is the kernel's expression of
    the split a store belongs to."""
    k_tiles = -(-K // BK)
    defines = {"SPLIT": split, "KT_SPLIT": -(-k_tiles // split), "BATCH": batch}
    if split == 1:
        defines.update({"PARAMS": params, "KILN_STORE(b, m, n, v)": "kiln_epilogue(ARGS, b, m, n, v)",
                        "KILN_STORE2(b, m, n, v0, v1)": "kiln_epilogue2(ARGS, b, m, n, v0, v1)"})
        return SplitK(defines)
    partial = STORE_PARTIAL.replace("blockIdx.y", split_index)
    pair = (f"(*(float2*)&{partial} = make_float2(v0, v1))" if N % 2 == 0     # n even: 8-byte aligned
            else f"({partial} = (v0), {partial.replace('(n)]', '(n) + 1]')} = (v1))")
    defines.update({"PARAMS": f"{params}, float* __restrict__ kiln_ws",
                    "KILN_STORE(b, m, n, v)": f"({partial} = (v))",
                    "KILN_STORE2(b, m, n, v0, v1)": pair})
    workspace = f"tmp{len(temporaries)}"
    temporaries.append(((split, batch, M, N), dtypes.float32))
    total = batch * M * -(-N // 2)
    launch = Launch("kiln_split_k_sum", args + (workspace,), (256, 1, 1), items=total, per_block=256, waves=8)
    return SplitK(defines, SUM_KERNEL, (workspace,), [launch])
