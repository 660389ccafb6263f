"""Attention for training on tensor cores (sm_80+): `attention_forward` and `attention_backward`
(`kiln_ops_builtin.attention_training`) as FlashAttention-2 computes them, float16 and bfloat16,
head dims 32, 64 and 128 (K's and V's equal).

Forward (`kiln_attention_train_forward`): a CTA owns NW * MT * 16 queries of one batch-head,
each of its NW warps MT * 16 of them; keys stream BN at a time through two shared-memory stages
(`cp.async`), S = Q K^T and O += P V on `mma.sync.m16n8k16` with float32 accumulators, the
online softmax in registers. It stores O in the inputs' dtype and each row's log-sum-exp
(natural log, float32; -inf for a row with no key).

Backward, deterministic (no atomics), every gradient rounded once at its store:
- `kiln_attention_train_delta`: delta = rowsum(dout * out) in float32 into a temporary;
- `kiln_attention_train_backward`, whose first CTAs compute dK and dV and the others dQ (the dQ
  blocks fill the last wave of the dK/dV blocks; knob ONE, else two kernels, `..._dkdv` and
  `..._dq`):
  - dK and dV (`backward_kv`): a CTA owns NW * MT * 16 keys (K and V in shared memory), its
    warps' rows are keys, and it walks the query tiles of BN rows (Q, dO, lse, delta; two
    stages): S^T = K Q^T, P^T = exp(S^T scale - lse) (0 where the causal mask drops the key),
    dV += P^T dO, dP^T = V dO^T, dS^T = P^T (dP^T - delta), dK += dS^T Q; dK * scale and dV at
    the end;
  - dQ (`backward_q`): a CTA owns NW * MT * 16 queries (Q and dO in shared memory) and walks the
    key tiles of BN rows: S, P, dP = dO V^T, dS as above, dQ += dS K; dQ * scale at the end.
Taking keys as the rows of the dK/dV kernel makes P^T and dS^T accumulators of their own, so
every product reads its first operand from registers or row-major shared memory (`ldmatrix`)
and its second with `ldmatrix` or `ldmatrix.trans`: nothing is staged transposed. Causal
attention skips whole tiles above the diagonal and masks the others elementwise.

The device code is `cuda/attention_train.cuh` (`kiln::attn_train`): C++ function templates over
the element type, head dim, knobs (`ForwardKnobs`, `BackwardKnobs`) and causality. Sizes (Lq,
Lk, the flattened batch-heads) are run-time kernel arguments (`CudaProgram.sizes`), so one
source serves every length; the scale is a literal of the source (it follows the head dim
unless given). Takes the operators' own tasks only (`own_task`: nothing fused), contiguous
inputs (the core's, as this template reads no views), lse in float32, a bool mask over at most
two leading dims (read through run-time strides, 0 where it broadcasts; every tile is then
masked elementwise); declines float32 and other head dims (the compute definitions then run
through the auto-scheduler).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from kiln.template import (CudaDialect, CudaProgram, KernelArgs, Knobs, Launch, Template, device_code, dtypes, ptx,
                           template_source)

from kiln_ops_builtin import attention_training
from kiln_ops_builtin.templates.own_task import own_call

HEAD_DIMS = (32, 64, 128)
MAX_SMEM = 227 * 1024
PAD = 8                                      # elements of padding per shared-memory row (16 bytes)
ELEMENTS = {dtypes.float16: "F16", dtypes.bfloat16: "BF16"}       # kiln::attn_train's element types
DELTA_THREADS = 256
NS = "kiln::attn_train"

KERNEL = r"""
extern "C" __global__ void __launch_bounds__({threads}) {name}({params}) {{
    extern __shared__ __align__(128) unsigned char kiln_smem[];
    const {ns}::Problem problem = {{{sizes}, {scale}, {{{mask}}}}};
    {ns}::{call};
}}
"""


def _rows(d: int) -> int:
    return d + PAD


@dataclass(frozen=True)
class ForwardKnobs(Knobs):
    """NW warps a CTA of NW * MT * 16 queries (MT 16-row MMA tiles a warp), keys BN at a time."""

    NW: int = 4
    MT: int = 2
    BN: int = 64

    def smem(self, d: int) -> int:
        return (self.NW * self.MT * 16 + 4 * self.BN) * _rows(d) * 2

    def valid(self) -> bool:
        return (self.NW in (2, 4, 8) and self.MT in (1, 2) and self.BN in (16, 32, 64, 128)
                and self.smem(max(HEAD_DIMS)) <= MAX_SMEM)

    @classmethod
    def space(cls, level: int) -> list[ForwardKnobs]:
        """Level 0: 128 queries on four warps, 64-key tiles (attention_flash's default); 1: query
        and key tiles and warps around it (on an H200 128-key tiles and 8 warps of 32 rows were
        never the fastest: benchmarks/attention_train_bench.py --knobs); 2: every valid one."""
        if level == 0:
            return [cls()]
        if level == 1:
            return [cls(), cls(MT=1), cls(BN=32), cls(NW=8, MT=1)]
        return [k for k in cls.grid(NW=(2, 4, 8), MT=(1, 2), BN=(32, 64, 128))]


@dataclass(frozen=True)
class BackwardKnobs(Knobs):
    """NW warps a CTA of NW * MT * 16 keys (dK, dV) or queries (dQ), MT 16-row MMA tiles a
    warp; the loop walks the other side BN rows at a time (at most one a thread). ONE: the dK/dV
    and dQ blocks in one launch (the dQ blocks fill the last wave; the kernel takes the larger
    register count of the two), else in two."""

    NW: int = 4
    MT: int = 1
    BN: int = 64
    ONE: bool = True

    def smem(self, d: int) -> int:
        """The larger of the dK/dV kernel's and the dQ kernel's (the same tiles, and lse and delta)."""
        return (2 * self.NW * self.MT * 16 + 4 * self.BN) * _rows(d) * 2 + 4 * self.BN * 4

    def valid(self) -> bool:
        return (self.NW in (2, 4, 8) and self.MT in (1, 2) and self.BN in (16, 32, 64, 128)
                and self.BN <= 32 * self.NW and self.smem(max(HEAD_DIMS)) <= MAX_SMEM)

    @classmethod
    def space(cls, level: int) -> list[BackwardKnobs]:
        """Level 0: 64 keys (queries) on four warps of one MMA tile, 64-row tiles walked, one
        launch (on an H200 the fastest or within 4% at GPT-2's and Llama's shapes); 1: tiles,
        warps and two launches around it; 2: every valid combination."""
        if level == 0:
            return [cls()]
        if level == 1:
            return [cls(), cls(ONE=False), cls(BN=32), cls(NW=8), cls(MT=2, BN=32)]
        return [k for k in cls.grid(NW=(2, 4, 8), MT=(1, 2), BN=(32, 64, 128), ONE=(True, False)) if k.valid()]


@dataclass(frozen=True)
class Problem:
    """What the template reads of an operator's own task: element type, head dim, causality,
    scale, the run-time sizes (Lq, Lk, flattened batch-heads) and, with a mask, its kernel
    argument and how it is read (heads of the second leading dim, then the strides of the
    leading dims, the queries and the keys; 0 where it broadcasts), run-time sizes too."""

    dtype: dtypes.DataType
    d: int
    causal: bool
    scale: float
    lq: int
    lk: int
    bh: int
    mask: str | None = None
    mask_sizes: tuple[int, ...] = ()

    @property
    def sizes(self) -> tuple[int, ...]:
        return (self.lq, self.lk, self.bh, *self.mask_sizes)


def _mask_sizes(mask, scores: tuple[int, ...]) -> tuple[int, ...] | None:
    """(heads, stride of the first leading dim, of the second, of the queries, of the keys) of a
    contiguous `mask` read as broadcast to `scores` [lead..., Lq, Lk]; None beyond two leading
    dims."""
    lead = len(scores) - 2
    if lead > 2:
        return None
    shape = (1,) * (len(scores) - len(mask.shape)) + tuple(mask.shape)
    strides, inner = [0] * len(shape), 1
    for d in reversed(range(len(shape))):
        strides[d] = 0 if shape[d] == 1 else inner
        inner *= shape[d]
    strides = [0] * (2 - lead) + strides
    heads = scores[1] if lead == 2 else 1
    return (heads, *strides)


def problem_of(task) -> Problem | None:
    """The problem of `task`, or None where the template does not take it."""
    definition = {"attention_forward": attention_training.attention_forward,
                  "attention_backward": attention_training.attention_backward}.get(task.name)
    call = own_call(task, definition) if definition is not None else None
    if call is None:
        return None
    q, k, v, mask = call["q"], call["k"], call["v"], call.get("mask")
    if q.dtype not in ELEMENTS or not q.dtype == k.dtype == v.dtype:
        return None
    d, lq, lk = q.shape[-1], q.shape[-2], k.shape[-2]
    if d not in HEAD_DIMS or v.shape[-1] != d or max(lq, lk) >= 1 << 30:
        return None
    if task.name == "attention_backward" and (call["dout"].dtype != q.dtype or call["out"].dtype != q.dtype
                                              or call["lse"].dtype != dtypes.float32):
        return None
    scale = 1.0 / math.sqrt(d) if call["scale"] is None else float(call["scale"])
    if not math.isfinite(scale):
        return None
    bh = 1
    for size in q.shape[:-2]:
        bh *= size
    if mask is None:
        return Problem(q.dtype, d, bool(call["is_causal"]), scale, lq, lk, bh)
    sizes = _mask_sizes(mask, tuple(q.shape[:-1]) + (lk,)) if mask.dtype.is_bool else None
    if sizes is None:
        return None
    return Problem(q.dtype, d, bool(call["is_causal"]), scale, lq, lk, bh,
                   KernelArgs.input(task.inputs.index(mask)), sizes)


def applies(task) -> bool:
    return problem_of(task) is not None


def _kernel(name: str, threads: int, params: list[str], p: Problem, call: str) -> str:
    sizes = ", ".join(KernelArgs.size(k) for k in range(3))
    if p.mask is None:
        mask = "nullptr, 1, 0, 0, 0, 0"
    else:
        mask = ", ".join([f"(const uint8_t*){p.mask}"] + [KernelArgs.size(k) for k in range(3, len(p.sizes))])
    return KERNEL.format(threads=threads, name=name, params=", ".join(params), ns=NS, sizes=sizes,
                         scale=f"{p.scale!r}f", mask=mask, call=call)


def _masked(p: Problem) -> str:
    return "false" if p.mask is None else "true"


def _source(kernels: list[str]) -> str:
    return template_source([device_code(__package__, "cuda/attention_train.cuh"), *kernels], {}, "",
                           (ptx.CP_ASYNC, ptx.LDMATRIX, ptx.MMA, ptx.CVT_EX2))


def _params(task, p: Problem, temporaries: int = 0) -> tuple[list[str], tuple[str, ...]]:
    """The kernels' parameters and arguments: inputs, outputs, float temporaries, sizes."""
    params = KernelArgs.params(CudaDialect(), task.inputs, task.outputs)
    params += [f"float* __restrict__ {KernelArgs.temporary(k)}" for k in range(temporaries)]
    params += [f"int64_t {KernelArgs.size(k)}" for k in range(len(p.sizes))]
    args = (*KernelArgs.args(len(task.inputs), len(task.outputs)),
            *(KernelArgs.temporary(k) for k in range(temporaries)), *(KernelArgs.size(k) for k in range(len(p.sizes))))
    return params, args


def render_forward(task, **knobs) -> CudaProgram:
    """The forward's program (q, k, v -> out, lse) at the setting `knobs` (`ForwardKnobs`' fields)."""
    p = problem_of(task)
    if p is None or task.name != "attention_forward":
        raise ValueError(f"attention_train_forward: does not take {task!r}")
    k = ForwardKnobs(**knobs)
    params, args = _params(task, p)
    threads, bm = 32 * k.NW, 16 * k.NW * k.MT
    e = f"{NS}::{ELEMENTS[p.dtype]}"
    call = (f"forward<{e}, {p.d}, {k.NW}, {k.MT}, {k.BN}, {str(p.causal).lower()}, {_masked(p)}>"
            f"(in0, in1, in2, out0, out1, problem, kiln_smem)")
    source = _source([_kernel("kiln_attention_train_forward", threads, params, p, call)])
    launch = Launch("kiln_attention_train_forward", args, (threads, 1, 1), grid=(-(-p.lq // bm) * p.bh, 1, 1),
                    smem=k.smem(p.d))
    return CudaProgram(source, [launch], alignment=16, sizes=p.sizes)


def render_backward(task, **knobs) -> CudaProgram:
    """The backward's program (dout, q, k, v, out, lse -> dq, dk, dv; delta in a temporary) at
    the setting `knobs` (`BackwardKnobs`' fields)."""
    p = problem_of(task)
    if p is None or task.name != "attention_backward":
        raise ValueError(f"attention_train_backward: does not take {task!r}")
    k = BackwardKnobs(**knobs)
    params, args = _params(task, p, temporaries=1)
    threads, rows = 32 * k.NW, 16 * k.NW * k.MT
    e, causal, dl = f"{NS}::{ELEMENTS[p.dtype]}", str(p.causal).lower(), KernelArgs.temporary(0)
    tiles = f"{e}, {p.d}, {k.NW}, {k.MT}, {k.BN}, {causal}, {_masked(p)}"
    kernels = [
        _kernel("kiln_attention_train_delta", DELTA_THREADS, params, p,
                f"delta<{e}, {p.d}, {DELTA_THREADS}>(in0, in4, {dl}, {KernelArgs.size(0)} * {KernelArgs.size(2)})"),
    ]
    smem = (2 * rows + 4 * k.BN) * _rows(p.d) * 2 + 4 * k.BN * 4        # backward_kv's, the larger
    row_count = p.lq * p.bh
    kv_ctas, q_ctas = -(-p.lk // rows) * p.bh, -(-p.lq // rows) * p.bh
    launches = [Launch("kiln_attention_train_delta", args, (DELTA_THREADS, 1, 1), items=row_count,
                       per_block=DELTA_THREADS * 8 // p.d, waves=8)]
    operands = f"in0, in1, in2, in3, in5, {dl}"
    if k.ONE:
        kernels.append(_kernel("kiln_attention_train_backward", threads, params, p,
                               f"backward<{tiles}>({operands}, out0, out1, out2, problem, kiln_smem)"))
        launches.append(Launch("kiln_attention_train_backward", args, (threads, 1, 1), grid=(kv_ctas + q_ctas, 1, 1),
                               smem=smem))
    else:
        kernels += [_kernel("kiln_attention_train_dkdv", threads, params, p,
                            f"backward_kv<{tiles}>({operands}, out1, out2, problem, kiln_smem, blockIdx.x)"),
                    _kernel("kiln_attention_train_dq", threads, params, p,
                            f"backward_q<{tiles}>({operands}, out0, problem, kiln_smem, blockIdx.x)")]
        launches += [Launch("kiln_attention_train_dkdv", args, (threads, 1, 1), grid=(kv_ctas, 1, 1), smem=smem),
                     Launch("kiln_attention_train_dq", args, (threads, 1, 1), grid=(q_ctas, 1, 1),
                            smem=(2 * rows + 4 * k.BN) * _rows(p.d) * 2)]
    return CudaProgram(_source(kernels), launches, [((row_count,), dtypes.float32)], alignment=16,
                       sizes=p.sizes)


def suggest_forward(task, sm_count: int) -> list[dict]:
    """Level 0 by head dim: 32-key tiles at 128 (the accumulators of 128 queries on four warps
    leave no registers for 64: on an H200, 10-20% faster at 1k-2k tokens), else `space(0)`'s;
    then level 1's others."""
    p = problem_of(task)
    first = ForwardKnobs(BN=32) if p is not None and p.d >= 128 else ForwardKnobs()
    return [first.as_dict()] + [k for k in ForwardKnobs.settings(1) if k != first.as_dict()]


FORWARD = Template("attention_train_forward", ("attention_forward",), "cuda", render_forward, priority=10,
                   applies=applies, space=ForwardKnobs.settings, suggest=suggest_forward, min_arch=80)
BACKWARD = Template("attention_train_backward", ("attention_backward",), "cuda", render_backward, priority=10,
                    applies=applies, space=BackwardKnobs.settings, min_arch=80)
