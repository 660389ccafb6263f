"""Scatters with atomics on CUDA: scatter_add, scatter_reduce, index_add, index_put with
accumulate and index_reduce.

The operators' compute definitions (`kiln_ops_builtin.scatter`) gather, for each output
element, over every candidate source; this template visits each source element once instead
and combines its value into its target with an atomic operation: atomicAdd for sums (float32,
float64, int32, int64), atomicMax/atomicMin for integer amax/amin, a compare-and-swap loop
for products and float amax/amin (NaN propagating, as the definitions' maximum). 16-bit
floats accumulate in a float32 temporary and are rounded once at the end (PyTorch's opmath
type, as the definitions do). Where each source goes, and its value, are the operator's
`Scattered` description rendered by the core's emitter into two device functions,
`kiln_target(params, s)` (the flat output offset, user indices wrapped and checked: an index
out of range traps) and `kiln_value(params, s)`.

The kernels, in order (each a grid-stride loop): where some outputs keep x's own value only if
no source lands on them (include_self=False) or a mean needs counts, zero the counts and count
the sources landing on each output; set the accumulators (x's value, or the reduction's
identity where sources land and x is left out); combine every source; where needed, divide
means and round 16-bit accumulators into the output. The order in which sources combine is not
fixed, so float sums and means may differ from the definitions' in the last bits, as
PyTorch's CUDA scatters do.

The operators declare `Traits(in_place="x")`, and the compiled graph may give the output x's
own buffer (an embedding's gradient scattered into its zero fill): the kernels keep that
promise, since x is read only by the initializing launch, element p where it writes
accumulator (or output) element p, and the launches after it (which combine, divide, round)
never read x.

Takes the operators' own tasks (`own_task`) of x of float32, float64, float16, bfloat16, int32
and int64; 8- and 16-bit integers, bool and 0-d x keep the gathering definitions.

The kernels are in `cuda/scatter_atomic_counts.cuh` (only where the program counts) and
`cuda/scatter_atomic.cuh`, the atomic combination in `cuda/scatter_combine.cuh`
(`kiln::scatter::combine`), over the program's `kiln_scatter_program` (its sizes, the flags and
the way of combining as enumerators, the accumulator type, the buffers' accessors and, for a
compare-and-swap loop, the combination `combined`) and the hooks above.
"""
from __future__ import annotations

import math

from kiln.template import (CudaDialect, CudaProgram, Emitter, KernelArgs, Launch, Template, Var, cast, device_code,
                           dtypes, row_major_strides, simplify, template_source, unravel)

from kiln_ops_builtin import scatter
from kiln_ops_builtin.templates.own_task import own_call

DEFINITIONS = {d.name: d for d in (scatter.scatter_add, scatter.scatter_reduce, scatter.index_add,
                                   scatter.index_put, scatter.index_reduce)}
ACCUMULATORS = {dtypes.float32: dtypes.float32, dtypes.float64: dtypes.float64, dtypes.float16: dtypes.float32,
                dtypes.bfloat16: dtypes.float32, dtypes.int32: dtypes.int32, dtypes.int64: dtypes.int64}
THREADS = 256
COMBINED = "    static __device__ __forceinline__ Acc combined(Acc a, Acc v) {{ return {}; }}\n"
_WORDS = {4: "unsigned int", 8: "unsigned long long"}     # an integer product's unsigned type, by size

PROGRAM = """struct kiln_scatter_program {{
    enum {{ THREADS = {threads}, INCLUDE_SELF = {include_self}, MEAN = {mean}, COMBINE = kiln::scatter::{combine} }};
    enum : int64_t {{ NUMEL = {numel}, SOURCES = {sources} }};
    using Acc = {acc};
    static __device__ __forceinline__ auto x({params}) {{ return {x}; }}
    static __device__ __forceinline__ auto out({params}) {{ return {out}; }}
    static __device__ __forceinline__ Acc* acc({params}) {{ return {acc_name}; }}
    static __device__ __forceinline__ int* counts({params}) {{ return {counts}; }}
    template <class V> static __device__ __forceinline__ auto load_x(V v) {{ return {load}; }}
    static __device__ __forceinline__ auto store(Acc v) {{ return {store}; }}
    static __device__ __forceinline__ Acc identity() {{ return {identity}; }}
    static __device__ __forceinline__ Acc divide(Acc a, Acc b) {{ return {divide}; }}
{combined}}};
"""


def plan(task):
    """(x, Scattered, reduction, include_self) of a task the template takes, else None."""
    definition = DEFINITIONS.get(task.name)
    call = own_call(task, definition) if definition is not None else None
    if call is None:
        return None
    x = call["x"]
    if x.ndim == 0 or x.dtype not in ACCUMULATORS or 0 in x.shape:
        return None
    found = scatter.reduction(task.name, call)
    return None if found is None else (x, *found)


def applies(task) -> bool:
    return plan(task) is not None


def _combine(how: str, acc: dtypes.DataType, d: CudaDialect) -> tuple[str, str]:
    """How a value v is combined into accumulator a (`kiln::scatter::Combine`), and where that
    is by compare-and-swap, the program's member `combined` (else nothing)."""
    if how in ("sum", "mean"):
        return "ADD", ""
    if how in ("amax", "amin") and not acc.is_float:
        return ("MAX" if how == "amax" else "MIN"), ""
    if how == "prod":
        word = _WORDS[acc.nbytes]
        combined = "a * v" if acc.is_float else f"({d.value_type(acc)})(({word})a * ({word})v)"
    else:
        combined = d.binary("max" if how == "amax" else "min", acc, "a", "v", acc)
    return "CAS", COMBINED.format(combined)


def _hooks(task, scattered, how: str, acc: dtypes.DataType, decl: list[str], d: CudaDialect) -> str:
    """`kiln_target(params, s)` and `kiln_value(params, s)` of source element s (flat)."""
    x = task.inputs[0]
    s = Var("s", max(1, math.prod(scattered.sources)))
    index = unravel(s, scattered.sources)
    names = {**KernelArgs.names(task.inputs), id(s): "s"}
    strides = {id(t): row_major_strides(t.shape) for t in task.inputs}
    flat = sum((i * stride for i, stride in zip(scattered.target(index), row_major_strides(x.shape))), 0)
    value = scattered.value(index)
    value = cast(cast(value, x.dtype), acc) if how in ("amax", "amin") else cast(value, acc)
    out = []
    for name, t, e in (("kiln_target", "int64_t", cast(flat, dtypes.int64)), ("kiln_value", d.value_type(acc), value)):
        em = Emitter(d, names, strides)
        result = em.emit(simplify(e))
        out.append(f"static __device__ __forceinline__ {t} {name}({', '.join(decl)}, int64_t s) {{\n"
                   + "\n".join(em.lines) + f"\n    return {result};\n}}\n")
    return "".join(out)


def _identity(how: str, acc: dtypes.DataType, d: CudaDialect) -> str:
    if how in ("sum", "mean"):
        return d.const(0, acc)
    if how == "prod":
        return d.const(1, acc)
    low = how == "amax"
    if acc.is_float:
        return d.const(-math.inf if low else math.inf, acc)
    bits = acc.nbytes * 8
    return d.const(-(1 << (bits - 1)) if low else (1 << (bits - 1)) - 1, acc)


def space(level: int) -> list[dict]:
    """One setting: the kernels are bound by memory and atomics, not by a tile."""
    return [{}]


def render(task) -> CudaProgram:
    found = plan(task)
    if found is None:
        raise ValueError(f"scatter_atomic: does not take {task!r}")
    x, scattered, how, include_self = found
    d = CudaDialect()
    acc = ACCUMULATORS[x.dtype]
    counting = how == "mean" or not include_self
    temporaries, acc_name, counts = [], KernelArgs.output(0), ""
    decl = KernelArgs.params(d, task.inputs, task.outputs)
    if acc != x.dtype:
        acc_name = KernelArgs.temporary(len(temporaries))
        decl.append(f"{d.value_type(acc)}* __restrict__ {acc_name}")
        temporaries.append((x.shape, acc))
    if counting:
        counts = KernelArgs.temporary(len(temporaries))
        decl.append(f"int* __restrict__ {counts}")
        temporaries.append((x.shape, dtypes.int32))
    args = KernelArgs.args(len(task.inputs)) + [KernelArgs.temporary(k) for k in range(len(temporaries))]
    numel, sources = math.prod(x.shape), math.prod(scattered.sources)
    combine, combined = _combine(how, acc, d)
    program = PROGRAM.format(
        threads=THREADS, numel=numel, sources=sources, include_self=int(include_self), mean=int(how == "mean"),
        acc=d.value_type(acc), params=", ".join(decl),
        x=KernelArgs.input(0), out=KernelArgs.output(0), acc_name=acc_name, counts=counts or "(int*)nullptr",
        load=d.load(x.dtype, "(v)"), store=d.store(x.dtype, "(v)"), identity=_identity(how, acc, d),
        divide="((a) / (b))" if acc.is_float else "((Acc)kiln_floordiv_i64((a), (b)))", combine=combine,
        combined=combined)
    defines = {"PARAMS": ", ".join(decl), "ARGS": ", ".join(args)}
    hooks = _hooks(task, scattered, how, acc, decl, d)
    block = (THREADS, 1, 1)
    names = tuple(args)
    over = lambda kernel, items: Launch(kernel, names, block, items=items, per_block=THREADS)
    launches = [over("kiln_scatter_zero", numel), over("kiln_scatter_count", sources)] if counting else []
    launches += [over("kiln_scatter_init", numel), over("kiln_scatter_apply", sources)]
    if acc != x.dtype or how == "mean":
        launches.append(over("kiln_scatter_finish", numel))
    files = ("cuda/scatter_atomic_counts.cuh",) * counting + ("cuda/scatter_atomic.cuh",)
    kernels = [device_code(__package__, "cuda/scatter_combine.cuh"), program, device_code(__package__, *files)]
    return CudaProgram(template_source(kernels, defines, hooks), launches, temporaries)


TEMPLATE = Template("scatter_atomic", tuple(DEFINITIONS), "cuda", render, priority=10, applies=applies, space=space)
