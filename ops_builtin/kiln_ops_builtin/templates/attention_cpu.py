"""Fused attention on the CPU: softmax(q k^T * scale + mask) v in one pass over the keys per
block of queries (the online softmax of FlashAttention), float32 inside for float32, float16
and bfloat16 inputs.

The threads share out (flat batch, block of BM queries) items. An item copies its queries once
into a float32 buffer [BM][D], then walks the keys BN at a time (causal attention stops at its
last query's diagonal): it copies the block's keys transposed into [D][BN] and its values into
[BN][DVP] (float32, zero-padded to whole vectors), computes the scores with a register-blocked
micro-kernel (`kiln_product`: MR queries by 2 vectors of keys, 8 with AVX-512, else 6, the
query element broadcast against the keys' vectors), scales them, applies the mask (`kiln_mask`, rendered by the core from whatever
computes it: a bool keeps, a float adds), the causal edge and the key count, and runs the
online softmax per query row (running maximum and sum in float32, `kiln_vexp` on whole
vectors, the row's accumulated output rescaled where the maximum moves); then the same
micro-kernel adds P V into the row outputs [BM][DVP]. A row whose keys were all masked
keeps sum 0 and gets zeros, as the operator defines. Each finished row goes out through the
core's row epilogue (`kiln_epilogue_row`), where fused epilogues (casts, a transpose and
reshape back to [B, L, H * D]) go.

The task is read by `attention_match.match_attention(task, "cpu")`: q, k and v straight from
their inputs with any strides but a unit column stride (head-transposed views need no copy;
grouped-query heads read key/value head h // group); it declines anything else (a computed
operand, float64), which the auto-scheduler keeps. Its sizes are the task's own
(`fixed_sizes_only`): attention of symbolic sizes (a growing KV cache, dynamic=True) stays with
the auto-scheduler, whose one build serves every size.
"""
from __future__ import annotations

from dataclasses import dataclass

from kiln.template import CpuProgram, KernelArgs, Knobs, Template, c_template_source, device_code, dtypes

from kiln_ops_builtin.templates.attention_match import Attention, match_attention

KERNEL = ("cpu/simd.h", "cpu/common.h", "cpu/attention.h")     # the device code (`cpu/*.h`)
# an operand of flat batch bh: what cpu/attention.h reads its q, k and v through
OPERAND = "static inline const ELEM* kiln_{name}(PARAMS, int64_t bh) {{ return (const ELEM*){param} + ({base}); }}\n"

# the operands' storage and its conversion to float (cpu/attention.h's ELEM and ELEM_FLOAT)
DTYPES = {dtypes.float32: ("float", "kiln_f32"), dtypes.float16: ("uint16_t", "kiln_h2f"),
          dtypes.bfloat16: ("uint16_t", "kiln_bf2f")}


@dataclass(frozen=True)
class AttentionKnobs(Knobs):
    """BM queries and BN keys per block: BM a multiple of 8, BN of 64 (whole micro-tiles on
    every vector width; a block's queries are computed in whole micro-tiles, AVX2's 6 queries
    tall: 64 as 66). One setting at every level (CPU templates are not timed)."""

    BM: int = 64
    BN: int = 64

    def valid(self) -> bool:
        return self.BM > 0 and self.BM % 8 == 0 and self.BN > 0 and self.BN % 64 == 0


def applies(task) -> bool:
    """Float32, float16 and bfloat16 attention whose q, k and v `match_attention` reads."""
    a = match_attention(task, "cpu")
    return a is not None and a.q.dtype == a.k.dtype == a.v.dtype and a.dtype in DTYPES


def render(task, **knobs) -> CpuProgram:
    """The program `kiln_kernel(inputs..., output)` for `task` at the setting `knobs`
    (`AttentionKnobs`' fields)."""
    a: Attention = match_attention(task, "cpu")
    if a is None:
        raise ValueError(f"attention_cpu: does not apply to task '{task.name}'")
    k = AttentionKnobs(**knobs)
    storage, load = DTYPES[a.dtype]
    defines = {
        "PARAMS": a.params, "ARGS": a.args, "BATCH": a.batch_count, "LQ": a.Lq, "LK": a.Lk, "D": a.D, "DV": a.Dv,
        "BM": k.BM, "BN": k.BN, "SCALE": f"{a.scale!r}f", "CAUSAL": int(a.causal), "HAS_MASK": int(a.mask is not None),
        "MASK_BOOL": int(a.mask == "bool"), "ELEM": storage, "ELEM_FLOAT": load,
        "Q_RS": f"(int64_t){a.q.row_stride}", "K_RS": f"(int64_t){a.k.row_stride}",
        "V_RS": f"(int64_t){a.v.row_stride}",
    }
    operands = "".join(OPERAND.format(name=name, param=op.param, base=op.base(a.batch, a.group, "bh"))
                       for name, op in (("q", a.q), ("k", a.k), ("v", a.v)))
    return CpuProgram(c_template_source([operands, device_code(__package__, *KERNEL)], defines, a.hooks),
                      "kiln_kernel", tuple(KernelArgs.args(len(task.inputs))))


TEMPLATE = Template("attention_cpu", ("attention",), "cpu", render, priority=10, applies=applies,
                    space=AttentionKnobs.settings, reads_views=True, fixed_sizes_only=True)
