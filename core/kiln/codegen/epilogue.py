"""The epilogue hooks: how a contraction template's accumulators become output elements.

A template computing `acc[b, m, n] = sum_k A[b, m, k] * B[b, k, n]` (`kiln.codegen.hooks`)
never spells how an output element is made from `acc`, nor where it goes: it calls

    kiln_epilogue(KILN_PARAMS, b, m, n, acc)

which `render_epilogue` renders from the output's compute definition (the element's value with
its reduction replaced by `acc`: a bias, an activation, a residual add, a cast, whatever fusion
put there) and which stores the element; `kiln_epilogue2(KILN_PARAMS, b, m, n, acc0, acc1)`
does the same for the neighbours n and n + 1, with one packed store where alignment allows
(`kiln.codegen.vector_epilogue`: eight or four neighbours at once).

What the epilogue reads per output element at `m * row_stride + n` (a residual) is an
`EpilogueSource`: a template may copy its tiles into shared memory ahead of the epilogue (TMA)
and read them there through `kiln_fetch2_staged`, instead of loading them from global memory
while it stores.
"""
from __future__ import annotations

from dataclasses import dataclass

from kiln import dtypes
from kiln.codegen.cuda import CudaDialect
from kiln.codegen.emitter import Emitter, KernelArgs, row_major_strides
from kiln.codegen.sizes import SizeArgs
from kiln.dtypes import DataType
from kiln.ir.compute import Task
from kiln.ir.expr import Check, Const, Expr, Load, Reduce, Select, Var, top_reduces, walk
from kiln.ir.inline import substitute
from kiln.ir.simplify import linear_terms, simplify
from kiln.ir.size import SymSize, scaled_variable


@dataclass(frozen=True)
class EpilogueSource:
    """An input the epilogue reads at element `m * row_stride + n` of GEMM element (m, n) (a
    residual add): its BM x BN tiles can be staged in shared memory. Sources are numbered in
    the order of the `sources` tuple, which `kiln_fetch2_staged` takes tile pointers in."""

    param: str
    dtype: DataType
    row_stride: int


@dataclass(frozen=True)
class EpilogueOutput:
    """What the epilogue hooks were rendered from, for a template that renders another form
    of them (`kiln.codegen.vector_epilogue`): the lowered task, its output, the kernel's
    parameter declarations, `index_of(bvar, mvar, nvar)` (the output's axes by id), the
    bounds of (b, m, n) and the symbolic sizes."""

    lowered: Task
    out: object
    decl: tuple[str, ...]
    index_of: object
    extents: tuple[int, int, int]
    sizes: SizeArgs | None = None


def offset_coefficients(load: Load) -> dict[int, tuple[Var, int]] | None:
    """{id(v): (v, c)} where the element `load` reads sits at sum(c * v) of its buffer, over the
    index variables v of extent > 1; None when its offset is no such sum with positive c (a
    constant term, a product or quotient of variables). A coefficient that is a multiple of
    symbolic sizes is a `SymSize`. The offset is simplified whole, so a reshape's
    (i // d) * d + i % d folds back into i."""
    flat = Const(0, dtypes.int64)
    for index, stride in zip(load.indices, row_major_strides(load.tensor.shape)):
        flat = flat + index * stride
    terms, const = linear_terms(simplify(flat))
    scaled = [(scaled_variable(t), k) for t, k in terms]
    if const or any(found is None or k <= 0 for found, k in scaled):
        return None
    coef: dict[int, tuple[Var, int]] = {}
    for (t, scale), k in scaled:
        if t.extent != 1:
            coef[id(t)] = (t, coef.get(id(t), (t, 0))[1] + k * scale)
    return coef


def unconditional_loads(value: Expr, row: Var) -> list[Load]:
    """The loads `value` always makes (not under a branch that reads memory, nor behind a check)
    whose element depends on `row`: with the GEMM row m, what an epilogue reads per output row
    (a residual), as opposed to per column (a bias, which stays in cache)."""
    found, seen = {}, set()

    def visit(e):
        if id(e) in seen or isinstance(e, (Const, Var, Reduce)):
            return
        seen.add(id(e))
        if isinstance(e, Load):
            if any(x is row for i in e.indices for x in walk(i)):
                found.setdefault(e.key(), e)
            return
        if isinstance(e, Select) and any(isinstance(x, (Load, Reduce)) for b in (e.a, e.b) for x in walk(b)):
            visit(e.cond)
        elif isinstance(e, Check):
            visit(e.ok)
        else:
            for k in e.children():
                visit(k)

    visit(value)
    return list(found.values())


def _pair(out, index_of, extents):
    """(b, m, [n, n1], the output's values at GEMM elements (b, m, n) and (b, m, n1)) over new
    index variables bounded by `extents`."""
    bvar, mvar = Var("b", extents[0]), Var("m", extents[1])
    nvars = [Var("n", extents[2]), Var("n1", extents[2])]
    return bvar, mvar, nvars, [simplify(substitute(out.value, index_of(bvar, mvar, nv))) for nv in nvars]


def _row_loads(mvar: Var, pair: list[Expr]) -> list[Load]:
    """The distinct loads the pair makes per row (`unconditional_loads`), in first-use order."""
    found = [load for value in pair for load in unconditional_loads(value, mvar)]
    return list({load.key(): load for load in found}.values())


def staged_at(load: Load, mvar: Var, nvars: list[Var]) -> tuple[int, int] | None:
    """(row stride, 0 or 1) where `load` reads element m * row stride + n (1: n + 1) of its
    input, else None."""
    coef = offset_coefficients(load)
    if coef is None or len(coef) != 2 or id(mvar) not in coef:
        return None
    delta = next((d for d, nv in enumerate(nvars) if coef.get(id(nv), (nv, 0))[1] == 1), None)
    return None if delta is None else (coef[id(mvar)][1], delta)


STAGED_DTYPES = (dtypes.float16, dtypes.bfloat16, dtypes.float32)
MAX_SOURCES = 2


def _sources(fetched: list[Load], names: dict, mvar: Var, nvars: list[Var]) -> tuple[EpilogueSource, ...]:
    """The inputs (of `STAGED_DTYPES`, at most `MAX_SOURCES`) that the per-row loads `fetched`
    read at m * row_stride + n."""
    found: dict = {}
    for load in fetched:
        at = staged_at(load, mvar, nvars)
        if at is not None and load.tensor.dtype in STAGED_DTYPES and len(found) < MAX_SOURCES:
            param = names[id(load.tensor)]
            found.setdefault((param, at[0]), EpilogueSource(param, load.tensor.dtype, at[0]))
    return tuple(found.values())


def staged_source(load: Load, names: dict, mvar: Var, nvars: list[Var],
                  sources: tuple[EpilogueSource, ...]) -> tuple[int, int] | None:
    """(k, 0 or 1) where `load` reads element (m, n) (1: (m, n + 1)) of `sources[k]`, else None."""
    at = staged_at(load, mvar, nvars)
    found = None if at is None else next((k for k, s in enumerate(sources)
                                          if (s.param, s.row_stride) == (names[id(load.tensor)], at[0])), None)
    return None if found is None else (found, at[1])


def contraction_epilogue(lowered, out, decl: list[str], index_of, n_contiguous: bool, extents,
                         sizes: SizeArgs) -> tuple[str, tuple[EpilogueSource, ...], EpilogueOutput]:
    """A contraction matcher's epilogue: `render_epilogue`'s hooks with the epilogue's sources
    staged (`kiln_fetch2_staged`), the sources, and what the hooks were rendered from."""
    text, sources = _render(lowered, out, decl, index_of, n_contiguous, extents, sizes, stage=True)
    return text, sources, EpilogueOutput(lowered, out, tuple(decl), index_of, extents, sizes)


def render_epilogue(lowered, out, decl: list[str], index_of, n_contiguous: bool, extents=(1 << 62,) * 3,
                    sizes: SizeArgs | None = None) -> str:
    """Device functions computing and storing output elements from accumulators:
    `kiln_epilogue(params, b, m, n, acc)` for GEMM element (b, m, n), and
    `kiln_epilogue2(params, b, m, n, acc0, acc1)` for (b, m, n) and (b, m, n + 1), n + 1 < N,
    with one packed store where n is the output's innermost, contiguous index and alignment
    allows (a symbolic innermost extent is tested at run time). `index_of(bvar, mvar, nvar)`
    maps the output's axes (by id) to expressions of them. `extents` bound (b, m, n), so that
    the simplifier can fold an unravelled index back. Symbolic sizes are written through
    `sizes`, whose parameters `decl` must already declare.

    The pair also comes in two halves, so that a template can have the loads of several rows
    in flight before it computes any of them: `kiln_fetch2(params, b, m, n, f)` loads what
    the pair reads per row (a residual) into a `kiln_fetched f`, and
    `kiln_epilogue2_fetched(params, b, m, n, acc0, acc1, f)` is `kiln_epilogue2` reading those
    values from `f`. (Called one after the other, every store of a row would otherwise wait
    for the next row's loads: the compiler cannot move a load above an earlier store that might
    write the same memory.) `kiln_prefetch(params, b, m, n)` asks for the lines of those loads
    at element (b, m, n) to be brought into L2 (a hint: it never faults), so that a template can
    start them long before its epilogue.

    `contraction_epilogue` adds the sources' hook, `kiln_fetch2_staged(params, b, m, n, f, at,
    src0, ..)`: `kiln_fetch2` reading the sources' elements from tiles the template staged in
    shared memory, element (m, n) of source k at `srck[at]` (`at`: its place in the BM x BN
    tile).

    For 16-bit outputs, `kiln_epilogue2_packed(params, b, m, n, acc0, acc1)` computes the pair
    as `kiln_epilogue2` does and returns it as one 32-bit word (n in the low half) instead of
    storing it, for a template that stores the output by other means (a TMA store)."""
    return _render(lowered, out, decl, index_of, n_contiguous, extents, sizes, stage=False)[0]


def _render(lowered, out, decl, index_of, n_contiguous, extents, sizes, stage: bool):
    """(`render_epilogue`'s hooks, plus `kiln_fetch2_staged` where `stage`; the sources staged)."""
    d = CudaDialect()
    N = out.shape[-1]
    bvar, mvar, nvars, pair = _pair(out, index_of, extents)
    names = KernelArgs.names(lowered.inputs)
    names.update({id(bvar): "b", id(mvar): "m", id(nvars[0]): "n", id(nvars[1]): "n1"})
    strides = {id(t): row_major_strides(t.shape) for t in lowered.inputs}
    out_strides = row_major_strides(out.shape)
    head = "static __device__ __forceinline__ void"
    out0 = KernelArgs.output(0)
    params = f"{', '.join(decl)}, int64_t b, int64_t m, int64_t n"
    acc_type = d.value_type(top_reduces(out.value)[0].dtype)
    fetched = _row_loads(mvar, pair)
    sources = _sources(fetched, names, mvar, nvars) if stage else ()
    staged = [staged_source(load, names, mvar, nvars, sources) for load in fetched] if sources else []

    def body(count: int, seeded: dict, packed: bool = False) -> list[str]:
        em = Emitter(d, names, strides, sizes=sizes)
        em.scopes[0].update(seeded)
        values, offsets = [], []
        for k in range(count):
            index = index_of(bvar, mvar, nvars[k])
            value = pair[k] if count == 2 else simplify(substitute(out.value, index))
            em.scopes[0][top_reduces(value)[0].key()] = f"acc{k}" if count == 2 else "acc"
            values.append(d.store(out.dtype, em.emit(value)))
            flat = sum(index[id(a)] * s for a, s, size in zip(out.axes, out_strides, out.shape) if s and size > 1) \
                if any(sz > 1 for sz in out.shape) else 0
            offsets.append(em.emit(simplify(flat)) if not isinstance(flat, int) else "0")
        size = out.dtype.nbytes
        if packed:
            em.line(f"return (uint32_t)(uint16_t)({values[0]}) | ((uint32_t)(uint16_t)({values[1]}) << 16);")
            return em.lines
        apart = [f"{out0}[{offsets[0]}] = {values[0]};", f"{out0}[{offsets[1]}] = {values[1]};"] if count == 2 else []
        if count == 1:
            em.line(f"{out0}[{offsets[0]}] = {values[0]};")
        elif n_contiguous and (isinstance(N, SymSize) or N % 2 == 0) and size in (2, 4):
            word = "uint32_t" if size == 2 else "uint64_t"
            as_bits = (lambda v: f"(uint32_t)(uint16_t)({v})") if size == 2 else (lambda v: f"(uint64_t)__float_as_uint({v})") \
                if out.dtype.is_float else (lambda v: f"(uint64_t)(uint32_t)({v})")
            packed = f"*({word}*)&{out0}[{offsets[0]}] = {as_bits(values[0])} | ({as_bits(values[1])} << {size * 8});"
            if isinstance(N, SymSize):      # other sizes of this source may be odd
                em.open(f"if ({em.size(N)} % 2 == 0)")
                em.line(packed)
                em.close()
                em.open("else")
                for line in apart:
                    em.line(line)
                em.close()
            else:
                em.line(packed)
        else:
            for line in apart:
                em.line(line)
        return em.lines

    fetch, prefetch = Emitter(d, names, strides, sizes=sizes), Emitter(d, names, strides, sizes=sizes)
    for k, load in enumerate(fetched):
        fetch.line(f"f.f{k} = {fetch.emit(load)};")
        if not any(x is nvars[1] for i in load.indices for x in walk(i)):
            prefetch.line(f'asm volatile("prefetch.global.L2 [%0];" :: "l"({names[id(load.tensor)]} + '
                          f'{prefetch.offset(load)}));')
    fields = "".join(f" {d.value_type(load.dtype)} f{k};" for k, load in enumerate(fetched))
    n1 = "    const int64_t n1 = n + 1;\n"
    staged_hook = ""
    if sources:
        em = Emitter(d, names, strides, sizes=sizes)
        for k, (load, at) in enumerate(zip(fetched, staged)):
            em.line(f"f.f{k} = {em.emit(load) if at is None else d.load(load.dtype, f'src{at[0]}[at + {at[1]}]')};")
        tiles = "".join(f", const {d.storage_type(s.dtype)}* src{k}" for k, s in enumerate(sources))
        staged_hook = (f"{head} kiln_fetch2_staged({params}, kiln_fetched& f, int at{tiles}) {{\n{n1}"
                       + "\n".join(em.lines) + "\n}\n")
    return "".join([
        f"{head} kiln_epilogue({params}, {acc_type} acc) {{\n" + "\n".join(body(1, {})) + "\n}\n",
        f"{head} kiln_epilogue2({params}, {acc_type} acc0, {acc_type} acc1) {{\n{n1}"
        + "\n".join(body(2, {})) + "\n}\n",
        f"{head.replace('void', 'uint32_t')} kiln_epilogue2_packed({params}, {acc_type} acc0, {acc_type} acc1) "
        f"{{\n{n1}" + "\n".join(body(2, {}, packed=True)) + "\n}\n" if out.dtype.nbytes == 2 else "",
        f"struct kiln_fetched {{{fields} }};\n",
        f"{head} kiln_fetch2({params}, kiln_fetched& f) {{\n{n1}" + "\n".join(fetch.lines) + "\n}\n",
        f"{head} kiln_prefetch({params}) {{\n" + "\n".join(prefetch.lines) + "\n}\n",
        f"{head} kiln_epilogue2_fetched({params}, {acc_type} acc0, {acc_type} acc1, const kiln_fetched& f) {{\n{n1}"
        + "\n".join(body(2, {load.key(): f"f.f{k}" for k, load in enumerate(fetched)})) + "\n}\n",
        staged_hook,
    ]), sources
