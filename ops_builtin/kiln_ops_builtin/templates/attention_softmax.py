"""The online softmax of the fused attention kernels, on tensor-core accumulator fragments in
registers: the device code `attention_flash` (on `mma.sync`), `attention_decode` (through
`attention_flash`'s tile step) and `attention_sm90` (on `wgmma`) share.

The device code is `cuda/attention_softmax.cuh` (its header tells the fragment layout), after
`cuda/attention.cuh` (the mask kinds): `CODE`. It reads a kernel's program struct, whose members
for it `members` renders: what `Attention.device_operands` gives (causality, the mask's kind,
the scale, the operands), RAW_MAX, and where the tile rows' queries are.
"""
from __future__ import annotations

from kiln.template import device_code
from kiln_ops_builtin.templates.attention_match import Attention

CODE = device_code(__package__, "cuda/attention.cuh", "cuda/attention_softmax.cuh")

MEMBERS = """\
    enum : bool {{ RAW_MAX = {raw_max} }};
    static __device__ __forceinline__ int query_i(int r, PARAMS) {{ return {i}; }}
    static __device__ __forceinline__ int64_t query_bh(int64_t bh, int r, PARAMS) {{ return {bh}; }}
    static __device__ __forceinline__ bool query_ok(int r, PARAMS) {{ return {ok}; }}
{operands}"""


def members(a: Attention, i: str = "r", bh: str = "bh", ok: str = "r < LQ") -> str:
    """The members of a program struct that `cuda/attention_softmax.cuh` reads for `a`, its
    operands 16-bit: `a.device_operands`', RAW_MAX (the row maximum is taken before scaling, as
    a positive scale without a float mask allows), and for tile row r of flat batch bh its query
    `query_i(r, ARGS)`, the query's flat batch `query_bh(bh, r, ARGS)` and whether it is a real
    query `query_ok(r, ARGS)`, as the C expressions `i`, `bh` and `ok` of r, bh and the sizes (by
    default tile row r is query r of flat batch bh)."""
    return MEMBERS.format(raw_max=int(a.scale > 0 and a.mask != "float"), i=i, bh=bh, ok=ok,
                          operands=a.device_operands("uint16_t"))
