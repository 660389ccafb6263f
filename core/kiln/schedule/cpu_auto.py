"""The CPU auto-scheduler's rule: any task of injective and reduction computes, as C with OpenMP.

Costly parts of a reduction's body that are the same for several elements of its buffer are
computed once, into temporaries of their own (`kiln.schedule.hoist`).

Each materialized compute (see `kiln.ir.inline`) becomes one loop nest. An injective compute
loops over its outer dimensions in parallel and over its last dimension innermost, so the C
compiler can vectorize it; a compute that reduces loops over its elements in parallel, each
element running its reduction loop.

Floating-point sums over many values (`CASCADE_BLOCK` or more) do not accumulate in one
sequence, whose error grows with the length: each block of CASCADE_BLOCK values sums on its
own, and the block sums combine pairwise (a binary counter of partial sums), so the error grows
with the block size plus the logarithm of the number of blocks, as in PyTorch's cascade sum.
Within a block, consecutive values go to SUM_LANES partial sums, which the C compiler keeps in
one vector register. A sum over a symbolic number of values is always cascaded, so that the
kernel's source is the same at every size.

Symbolic sizes (`kiln.ir.size`) are kernel arguments (`kiln.codegen.sizes`).

A task's row stores (`kiln.ir.row_stores`) run after the loop nest of the later of their two
buffers, one element after the other (where two offsets are equal the later element wins, as
in `kiln.schedule.store_rows`), and only where no check of the kernel failed: an index out of
range leaves the input as it was.
"""
from __future__ import annotations

from kiln.codegen.c import CDialect
from kiln import dtypes
from kiln.codegen.emitter import Emitter, KernelArgs, numel, reduce_combine, row_major_strides
from kiln.codegen.sizes import SizeArgs
from kiln.ir.compute import Compute
from kiln.ir.expr import Reduce, SizeVar, Var, as_expr, walk
from kiln.ir.inline import Lowered, substitute
from kiln.ir.simplify import bounds, simplify
from kiln.runtime.cpu import CpuProgram
from kiln.runtime.kernel_errors import KernelCheck
from kiln.schedule.hoist import hoist_invariants
from kiln.schedule.store_rows import row_store, stores_after

PARALLEL_THRESHOLD = 1 << 15
CASCADE_BLOCK = 128
SUM_LANES = 8           # a block's values go to this many partial sums, a vector's worth


class CpuEmitter(Emitter):
    """The C emitter with cascaded floating-point sums (see the module doc)."""

    def _reduce(self, e: Reduce, key) -> str:
        if e.op != "sum" or not e.body.dtype.is_float or _most_values(e) <= CASCADE_BLOCK:
            return super()._reduce(e, key)
        d, t = self.dialect, e.body.dtype
        vt = d.value_type(t)
        extents = [self.emit(as_expr(a.extent, dtypes.int64)) for a in e.axes]
        total = self.let(dtypes.int64, " * ".join(f"(int64_t)({x})" for x in extents))
        acc, levels, blocks, part = self.fresh("acc"), self.fresh("lvl"), self.fresh("nb"), self.fresh("part")
        start, flat, level, carry, k = (self.fresh(p) for p in ("rb", "f", "k", "c", "k"))
        self.line(f"{vt} {acc} = {d.const(0, t)};")
        self.line(f"{vt} {levels}[64];")
        self.line(f"int64_t {blocks} = 0;")
        lanes, end, lane = self.fresh("lane"), self.fresh("end"), self.fresh("j")
        self.open(f"for (int64_t {start} = 0; {start} < {total}; {start} += {CASCADE_BLOCK})")
        self.line(f"const int64_t {end} = {start} + {CASCADE_BLOCK} < {total} ? {start} + {CASCADE_BLOCK} : {total};")
        self.line(f"{vt} {lanes}[{SUM_LANES}] = {{{d.const(0, t)}}};")
        self.line(f"int64_t {flat} = {start};")
        # SUM_LANES consecutive values into SUM_LANES partial sums (a vector), then the rest
        self.open(f"for (; {flat} + {SUM_LANES} <= {end}; {flat} += {SUM_LANES})")
        self.open(f"for (int {lane} = 0; {lane} < {SUM_LANES}; ++{lane})")
        self._sum_value(e, extents, f"{flat} + {lane}", f"{lanes}[{lane}]")
        self.close()
        self.close()
        self.open(f"for (; {flat} < {end}; ++{flat})")
        self._sum_value(e, extents, flat, f"{lanes}[0]")
        self.close()
        self.line(f"{vt} {part} = {_pairwise([f'{lanes}[{k}]' for k in range(SUM_LANES)])};")
        # block number nb + 1 merges the levels of its trailing zero bits, then takes the next
        self.line(f"int {level} = 0;")
        self.line(f"++{blocks};")
        self.open(f"for (int64_t {carry} = {blocks}; ({carry} & 1) == 0; {carry} >>= 1, ++{level})")
        self.line(f"{part} = {levels}[{level}] + {part};")
        self.close()
        self.line(f"{levels}[{level}] = {part};")
        self.close()
        self.open(f"for (int {k} = 0; {k} < 64; ++{k})")
        self.line(f"if (({blocks} >> {k}) & 1) {acc} = {levels}[{k}] + {acc};")
        self.close()
        self.scopes[-1][key] = acc
        return acc

    def _sum_value(self, e: Reduce, extents: list[str], flat: str, acc: str) -> None:
        """Add the value of `e`'s body at flat position `flat` of its axes to `acc`."""
        inner = "1"
        for axis, extent in reversed(list(zip(e.axes, extents))):
            name = self.fresh("r")
            self.names[id(axis)] = name
            self.line(f"const int64_t {name} = (({flat}) / ({inner})) % ({extent});" if len(extents) > 1
                      else f"const int64_t {name} = {flat};")
            inner = f"{inner} * ({extent})"
        self.line(reduce_combine("sum", e.body.dtype, acc, self.emit(e.body), self.dialect))


def _pairwise(terms: list[str]) -> str:
    """The sum of `terms` added pairwise."""
    while len(terms) > 1:
        terms = [f"({a} + {b})" for a, b in zip(terms[::2], terms[1::2])] + terms[len(terms) // 2 * 2:]
    return terms[0]


def _most_values(e: Reduce) -> int:
    """An upper bound of the number of values `e` reduces (unknown and symbolic extents count
    as many)."""
    n = 1
    for axis in e.axes:
        extent = as_expr(axis.extent, dtypes.int64)
        b = bounds(extent)
        n *= b[1] if b is not None and not any(isinstance(x, SizeVar) for x in walk(extent)) else 1 << 30
    return n


def _loop_nest(em: Emitter, buf: Compute, name: str) -> None:
    """Emit the loops writing every element of `buf` to the C array `name`."""
    shape = buf.shape
    items = numel(shape)
    if items == 0:
        return
    heavy = buf.has_reduce
    last = 1 if (heavy or not shape) else shape[-1]
    outer = items // last
    o, il = Var("o", outer), Var("il", last)
    flat = o * last + il if last > 1 else o
    index, stride = {}, 1
    outer_axes = list(zip(buf.axes, shape))
    if last > 1:
        index[id(buf.axes[-1])] = il
        outer_axes = outer_axes[:-1]
    for axis, size in reversed(outer_axes):
        index[id(axis)] = simplify((o // stride) % size)
        stride *= size
    value = simplify(substitute(buf.value, index))
    work = items * (16 if heavy else 1)
    pragma = f"#pragma omp parallel for schedule(static) if({em.size(work)} > {PARALLEL_THRESHOLD})"
    if outer > 1 or last == 1:
        em.line(pragma)
        em.names[id(o)] = "o"
        em.open(f"for (int64_t o = 0; o < {em.size(outer)}; ++o)")
    else:
        em.names[id(o)] = "0"
    if last > 1:
        if outer == 1:
            em.line(pragma)
        em.names[id(il)] = "il"
        em.open(f"for (int64_t il = 0; il < {em.size(last)}; ++il)")
    v = em.emit(value)
    em.line(f"{name}[{em.emit(simplify(flat))}] = {em.dialect.store(buf.dtype, v)};")
    for _ in range(int(outer > 1 or last == 1) + int(last > 1)):
        em.close()


def render_cpu(lowered: Lowered, kernel_name: str) -> tuple[str, list[KernelCheck], SizeArgs]:
    """C source of one function `kernel_name(inputs..., outputs..., status, sizes...)`
    computing the task, the checks whose codes it may write to `status` (see
    `kiln.runtime.kernel_errors`) and its symbolic sizes."""
    d = CDialect()
    temps = lowered.temporaries
    names = KernelArgs.names(lowered.inputs, lowered.outputs, temps)
    params = KernelArgs.params(d, lowered.inputs, lowered.outputs)
    strides = {id(t): row_major_strides(t.shape) for t in lowered.inputs + lowered.buffers}
    params.append(f"int64_t* __restrict__ {KernelArgs.STATUS}")
    sizes = SizeArgs()
    em = CpuEmitter(d, names, strides, sizes=sizes)
    for t in temps:
        em.line(f"{d.storage_type(t.dtype)}* {names[id(t)]} = ({d.storage_type(t.dtype)}*)malloc("
                f"{em.size(max(numel(t.shape), 1))} * sizeof({d.storage_type(t.dtype)}));")
    for buf in lowered.buffers:
        _loop_nest(em, buf, names[id(buf)])
        for store in stores_after(lowered, buf):
            em.open(f"if ({KernelArgs.STATUS}[0] == 0) for (int64_t i = 0; i < {em.size(numel(buf.shape))}; ++i)")
            em.line(row_store(lowered, store, names, "i"))
            em.close()
    for t in temps:
        em.line(f"free({names[id(t)]});")
    body = "\n".join(em.lines)
    checks = [KernelCheck(c.error, c.message) for c in em.checks]
    params += sizes.declarations()
    return f"{d.prelude}\nvoid {kernel_name}({', '.join(params)}) {{\n{body}\n}}\n", checks, sizes


def schedule(lowered: Lowered) -> CpuProgram:
    """The CPU program of `lowered` (it takes every task); the kernel takes a status buffer
    after its tensors, where its checks report (see `kiln.runtime.kernel_errors`), then its
    symbolic sizes."""
    args = KernelArgs.args(len(lowered.inputs), len(lowered.outputs)) + [KernelArgs.STATUS]
    source, checks, sizes = render_cpu(hoist_invariants(lowered), "kiln_kernel")
    return CpuProgram(source, "kiln_kernel", tuple(args), tuple(checks), sizes.values)
