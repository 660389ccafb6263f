"""An embedding table's gradient on CUDA (the operator `embedding_backward`), deterministic, with
scratch of the tokens' size only.

The operator's compute definition (`kiln_ops_builtin.scatter.embedding_backward`) gathers, for
each of the table's V x D elements, over all T tokens; torch's decomposition scatters the token
gradients into zeros of the table's size in float32 and casts that (a float32 copy of the table
in between). This template sorts the tokens by index and sums each index's rows in float32
instead, writing each row of the result once, rounded to its dtype, as PyTorch's CUDA
embedding backward does (sort, then sums of segments), with no atomics:

1. `zero`: every element of the output is zero (the rows no token adds to, the padding row);
2. `sort`: a stable sort of the tokens by index, by counting (token t's sorted position is the
   number of tokens before it in (index, position) order: O(T^2) comparisons, a few
   microseconds for T of a few thousand, about 0.1 ms for 16K tokens), with the bounds of each
   index's run of sorted positions; an index outside [0, V) traps;
3. `chunks`: the sorted positions are cut into chunks of CHUNK; a block sums, for THREADS columns,
   its chunk's grad rows in order, one run at a time: a run inside the chunk is rounded into its
   row of the output, the part of a run that crosses the chunk's start or end is left in float32
   scratch (`head`, `tail`: two rows of D per chunk);
4. `combine`: in the chunk where such a run ends, its parts are added in order and the sum
   rounded into its row.

Scratch: three int32 values per token and 2 x ceil(T / CHUNK) x D accumulators (float32, or
float64 for float64 grads): 256 KB for Llama's T = 512, D = 2048 where the float32 table is
262 MB. Each row's sum runs in token order, within a chunk and then chunk by chunk, so it may
differ from a sequential float32 sum (the CPU definition's) in the last bits of float32 before
the rounding; the result does not change from run to run.

Takes the operator's own tasks (`own_task`: fusion leaves it alone) with fewer than 2^31 tokens.
The device code is `cuda/embedding_grad.cuh`, over the program's `kiln_embedding_grad_program`
(its sizes and knobs as enumerators, the accumulator type, where its buffers are, the element
conversions and the failure of an index out of range), which this module renders.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from kiln.template import (CudaDialect, CudaProgram, KernelArgs, Knobs, Launch, Template, device_code, dtypes,
                           template_source)

from kiln_ops_builtin import scatter
from kiln_ops_builtin.templates.own_task import own_call

MAX_TOKENS = 2 ** 31 - 1          # sorted positions are int32

PROGRAM = """struct kiln_embedding_grad_program {{
    enum {{ THREADS = {threads}, CHUNK = {chunk} }};
    enum : int64_t {{ TOKENS = {tokens}, WIDTH = {width}, ROWS = {rows}, PADDING = {padding}, CHUNKS = {chunks} }};
    using Acc = {acc};
    static __device__ __forceinline__ auto grad({params}) {{ return {grad}; }}
    static __device__ __forceinline__ auto indices({params}) {{ return {indices}; }}
    static __device__ __forceinline__ auto out({params}) {{ return {out}; }}
    static __device__ __forceinline__ int* order({params}) {{ return {order}; }}
    static __device__ __forceinline__ int* first({params}) {{ return {order} + TOKENS; }}
    static __device__ __forceinline__ int* last({params}) {{ return {order} + 2 * TOKENS; }}
    static __device__ __forceinline__ Acc* head({params}) {{ return {parts}; }}
    static __device__ __forceinline__ Acc* tail({params}) {{ return {parts} + CHUNKS * WIDTH; }}
    template <class V> static __device__ __forceinline__ Acc load(V v) {{ return (Acc){load}; }}
    static __device__ __forceinline__ auto store(Acc v) {{ return {store}; }}
    static __device__ __forceinline__ void fail(int64_t index) {fail}
}};
"""


@dataclass(frozen=True)
class EmbeddingGradKnobs(Knobs):
    """THREADS columns a block (and tokens a block of the sort); CHUNK sorted positions a block
    of `chunks` sums before its parts of long runs go to `combine`."""

    THREADS: int = 256
    CHUNK: int = 32

    def valid(self) -> bool:
        return self.THREADS in (128, 256, 512) and self.CHUNK in (8, 16, 32, 64, 128)

    @classmethod
    def space(cls, level: int) -> list["EmbeddingGradKnobs"]:
        if level == 0:
            return [cls()]
        out = cls.grid(CHUNK=(16, 32, 64))
        return out if level < 2 else out + cls.grid(THREADS=(128, 512), CHUNK=(16, 32, 64, 128))


def plan(task):
    """(grad, indices, num_weights, padding row or -1) of a task the template takes, else None."""
    call = own_call(task, scatter.embedding_backward)
    if call is None:
        return None
    grad, indices, rows = call["grad"], call["indices"], call["num_weights"]
    if grad.shape[0] > MAX_TOKENS or grad.dtype not in (dtypes.float32, dtypes.float64, dtypes.float16,
                                                        dtypes.bfloat16):
        return None
    padding = call.get("padding_idx", -1)
    return grad, indices, rows, padding if isinstance(padding, int) and 0 <= padding < rows else -1


def applies(task) -> bool:
    return plan(task) is not None


def render(task, **knobs) -> CudaProgram:
    found = plan(task)
    if found is None:
        raise ValueError(f"embedding_grad: does not take {task!r}")
    k = EmbeddingGradKnobs(**knobs)
    grad, indices, rows, padding = found
    tokens, width = grad.shape
    d = CudaDialect()
    acc = dtypes.float64 if grad.dtype == dtypes.float64 else dtypes.float32
    chunks = -(-tokens // k.CHUNK)
    order, parts = KernelArgs.temporary(0), KernelArgs.temporary(1)
    temporaries = [((3, tokens), dtypes.int32), ((2, chunks, width), acc)]
    decl = KernelArgs.params(d, task.inputs, task.outputs) + [f"int* __restrict__ {order}",
                                                               f"{d.value_type(acc)}* __restrict__ {parts}"]
    args = KernelArgs.args(len(task.inputs)) + [order, parts]
    message = f"Kiln: IndexError: embedding_backward: index %lld is out of range for a weight of {rows} rows"
    program = PROGRAM.format(
        threads=k.THREADS, chunk=k.CHUNK, tokens=tokens, width=width, rows=rows, padding=padding, chunks=chunks,
        acc=d.value_type(acc), params=", ".join(decl), grad=KernelArgs.input(0), indices=KernelArgs.input(1),
        out=KernelArgs.output(0), order=order, parts=parts, load=d.load(grad.dtype, "(v)"),
        store=d.store(grad.dtype, "(v)"),
        fail=f'{{ printf("{message}\\n", (long long)index); __trap(); }}')
    names, block = tuple(args), (k.THREADS, 1, 1)
    columns = -(-width // k.THREADS)
    launches = [Launch("kiln_embedding_grad_zero", names, block, items=rows * width, per_block=k.THREADS),
                Launch("kiln_embedding_grad_sort", names, block, grid=(-(-tokens // k.THREADS), 1, 1)),
                Launch("kiln_embedding_grad_chunks", names, block, grid=(chunks, columns, 1)),
                Launch("kiln_embedding_grad_combine", names, block, grid=(chunks, columns, 1))]
    defines = {"PARAMS": ", ".join(decl), "ARGS": ", ".join(args)}
    kernels = [program, device_code(__package__, "cuda/embedding_grad.cuh")]
    return CudaProgram(template_source(kernels, defines, ""), launches, temporaries)


def space(level: int) -> list[dict]:
    return EmbeddingGradKnobs.settings(level)


TEMPLATE = Template("embedding_grad", (scatter.embedding_backward.name,), "cuda", render, priority=10,
                    applies=applies, space=space)
