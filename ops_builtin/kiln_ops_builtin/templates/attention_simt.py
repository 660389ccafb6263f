"""Fused attention in float32 on CUDA cores (any sm_70+): the online softmax of FlashAttention
without tensor cores, for the float32 models the 16-bit templates do not take (BERT at float32).

A CTA owns BM = NW * R queries of one (batch, head): each of its NW warps R query rows. It walks
the keys 32 at a time: the tile's K and V rows go to shared memory (K's rows padded by one
float, so that lane j reading row j stays in its own bank), and per query row lane j computes
the score of key j (a dot product over D, the query read from shared memory as a broadcast),
scaled into the log2 domain, masked (the mask hook; keys past LK and, causal, after the query),
then the warp takes the row's new maximum and sum by shuffles, and each lane adds the tile's
p_j V[j] to the output columns it owns (pairs 2 * lane + 64 * c). A fully masked row keeps sum 0
and gets zeros, as the operator defines. Causal attention skips the tiles after the CTA's last
query. Outputs go through the epilogue hooks (`kiln_epilogue2`), where fused epilogues go.

The task is read by `attention_match.match_attention`, as for `attention_flash`: q, k and v
straight from their inputs (a [B, L, H, D] view needs no copy; key/value head h // group for
grouped-query attention). Symbolic sizes are kernel arguments; `suggest` buckets them.

The device code is `cuda/attention_simt.cuh`: the kernel `kiln_attention_simt`, reading the
program's `kiln_attention_simt_program` rendered here: the knobs (`AttentionSimtKnobs`) and the
head dim, and the task's operands, sizes, scale and mask kind
(`Attention.device_operands`).
"""
from __future__ import annotations

from dataclasses import dataclass

from kiln.template import CudaProgram, Knobs, Launch, Template, as_dim, device_code, dtypes, template_source
from kiln_ops_builtin.templates.attention_match import Attention, match_attention
from kiln_ops_builtin.templates.split_k import bucket

BN = 32                       # keys per tile: one per lane (as in cuda/attention_simt.cuh)
MAX_D = 128                   # output columns: two per lane per 64

# What cuda/attention_simt.cuh's kernel reads of a program (the header of the .cuh lists it)
PROGRAM = """
struct kiln_attention_simt_program {{
    enum : int {{ NW = {nw}, R = {r}, D = {d} }};
{operands}}};
"""


@dataclass(frozen=True)
class AttentionSimtKnobs(Knobs):
    """NW warps a CTA, R query rows a warp."""

    NW: int = 4
    R: int = 4

    def valid(self) -> bool:
        return self.NW in (1, 2, 4, 8) and self.R in (1, 2, 4)

    @classmethod
    def space(cls, level: int) -> list[AttentionSimtKnobs]:
        """Level 0: four warps of four query rows; 1 and 2: 4 or 8 warps of 1, 2 or 4 rows."""
        if level == 0:
            return [cls()]
        return cls.grid(NW=(4, 8), R=(1, 2, 4))


def padded(d: int) -> int:
    """V's row length in shared memory: the head dim in whole 64-column blocks (two per lane)."""
    return -(-d // 64) * 64


def smem_bytes(knobs: AttentionSimtKnobs, d: int) -> int:
    return 4 * (knobs.NW * knobs.R * d + BN * (d + 1) + BN * padded(d))


def applies(task) -> bool:
    """float32 attention with D == Dv, even and at most MAX_D (the 16-bit types are the
    tensor-core templates')."""
    a = match_attention(task)
    return (a is not None and a.dtype == dtypes.float32 and a.q.dtype == a.k.dtype == a.v.dtype == dtypes.float32
            and a.D == a.Dv and a.D % 2 == 0 and a.D <= MAX_D)


def suggest(task, sm_count: int) -> list[dict]:
    """Four warps of four rows where that gives a CTA per multiprocessor, else of fewer rows (short
    sequences, few heads); symbolic sizes count as their bucket, so a bucket shares one source."""
    a = match_attention(task)
    Lq, batch = bucket(a.Lq), bucket(a.batch_count)
    r = next((r for r in (4, 2) if -(-Lq // (4 * r)) * batch >= sm_count), 1)
    first = AttentionSimtKnobs(NW=4, R=r).as_dict()
    return [first] + [k for k in AttentionSimtKnobs.settings(1) if k != first]


def render(task, **knobs) -> CudaProgram:
    """The kernel for `task` (see the module doc) at the setting `knobs` (`AttentionSimtKnobs`' fields)."""
    a: Attention = match_attention(task)
    k = AttentionSimtKnobs(**knobs)
    m_blocks = (a.Lq + k.NW * k.R - 1) // (k.NW * k.R)
    program = PROGRAM.format(nw=k.NW, r=k.R, d=a.D, operands=a.device_operands("float"))
    source = template_source([device_code(__package__, "cuda/attention.cuh"), program,
                              device_code(__package__, "cuda/attention_simt.cuh")],
                             {**a.device_defines(), "M_BLOCKS": a.int_text(m_blocks)}, a.hooks, ())
    launch = Launch("kiln_attention_simt", tuple(a.args.split(", ")), (k.NW * 32, 1, 1),
                    grid=(as_dim(m_blocks * a.batch_count), 1, 1), smem=smem_bytes(k, a.D))
    return CudaProgram(source, [launch], alignment=16, sizes=a.sizes.values)


TEMPLATE = Template("attention_simt", ("attention",), "cuda", render, priority=10, applies=applies,
                    space=AttentionSimtKnobs.settings, suggest=suggest, reads_views=True, symbolic=True)
