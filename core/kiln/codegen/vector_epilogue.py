"""The vector epilogue hook: a template's thread stores several neighbouring outputs at once.

`render_vector_epilogue` renders

    kiln_epilogue_v(KILN_PARAMS, b, m, n, acc)

which computes GEMM elements (b, m, n + k) for k < V from `acc[k]` (each as `kiln_epilogue`
would: bias, activation, residual, cast) and stores them as one `kiln_pack`, for templates whose
threads own V consecutive output channels of channels-last data (16 bytes of float16). n must
be a multiple of V, and n + V <= N. What the elements read at consecutive offsets (a bias by
channel, a residual of the output's layout, a per-image scale) is loaded as packs too; any
other read stays scalar. Only outputs whose innermost index is n and whose last dim is a
multiple of V qualify (`vector_stores`). With epilogue sources (`kiln.codegen.hooks`) the hook
takes `int at, const T* src0, ..` after `acc`, and reads their packs from the staged tiles.
"""
from __future__ import annotations

from kiln.codegen.cuda import CudaDialect
from kiln.codegen.emitter import Emitter, KernelArgs, row_major_strides
from kiln.codegen.epilogue import EpilogueSource, staged_source, unconditional_loads
from kiln.ir.expr import Expr, Var, top_reduces, walk
from kiln.ir.inline import substitute
from kiln.ir.simplify import linear_terms, simplify


def _flat(indices, shape) -> Expr | int:
    terms = [i * s for i, s, size in zip(indices, row_major_strides(shape), shape) if size > 1]
    return simplify(sum(terms[1:], terms[0])) if terms else 0


def _aligned_at(offset, n: Var, vector: int) -> bool:
    """Whether `offset` is n plus terms that are multiples of `vector` and do not use n."""
    if isinstance(offset, int):
        return False
    terms, const = linear_terms(offset)
    uses_n = [(t, k) for t, k in terms if any(x is n for x in walk(t))]
    return (uses_n == [(n, 1)] and const % vector == 0
            and all(k % vector == 0 for t, k in terms if t is not n))


def _stores(out, index: dict, n: Var, vector: int) -> bool:
    return out.shape[-1] % vector == 0 and _aligned_at(_flat([index[id(a)] for a in out.axes], out.shape), n,
                                                       vector)


def _variables(extents) -> tuple[Var, Var, Var]:
    return Var("b", extents[0]), Var("m", extents[1]), Var("n", extents[2])


def vector_stores(out, index_of, vector: int, extents=(1 << 62,) * 3) -> bool:
    """Whether output `out`, its axes indexed by `index_of(bvar, mvar, nvar)` (see
    `render_vector_epilogue`), stores elements n .. n + vector - 1 at consecutive offsets, the
    first a multiple of `vector`."""
    b, m, n = _variables(extents)
    return _stores(out, index_of(b, m, n), n, vector)


def _store(base: str, offset: str, values: list[str], dtype) -> str:
    """The statements storing `values` (of `dtype`) at `base[offset]` and after: as stores of up
    to four 32-bit words by intrinsic (16 bytes each; a pack of wider elements than the template's
    inputs, a float32 cast of float16 channels, takes several) where they make whole words of 2-
    or 4-byte elements (NVVM splits some plain vector-typed stores into words), else one by one."""
    size = dtype.nbytes
    if size not in (2, 4) or len(values) * size < 4:
        return " ".join(f"{base}[{offset} + {k}] = {v};" for k, v in enumerate(values))
    if size == 2:
        words = [f"((uint32_t)(uint16_t)({lo}) | ((uint32_t)(uint16_t)({hi}) << 16))"
                 for lo, hi in zip(values[::2], values[1::2])]
    else:
        words = [f"__float_as_uint({v})" if dtype.is_float else f"(uint32_t)({v})" for v in values]
    per_word = 4 // size
    stores = []
    for first in range(0, len(words), 4):
        chunk, ref = words[first:first + 4], f"{base}[{offset} + {first * per_word}]" if first else f"{base}[{offset}]"
        stores.append(f"__stwb((unsigned*)&{ref}, {chunk[0]});" if len(chunk) == 1 else
                      f"__stwb((uint{len(chunk)}*)&{ref}, make_uint{len(chunk)}({', '.join(chunk)}));")
    return " ".join(stores)


def render_vector_epilogue(lowered, out, decl, index_of, vector: int, extents=(1 << 62,) * 3, sizes=None,
                           sources: tuple[EpilogueSource, ...] = ()) -> str:
    """The device function `kiln_epilogue_v(params, b, m, n, const ACC* acc)` (see the module
    docs) of output `out` of `lowered`, over kernel parameters `decl`. `index_of(bvar, mvar,
    nvar)` maps the output's axes (by id) to expressions of them; `extents` bound (b, m, n).
    Symbolic sizes are written through `sizes` (a `kiln.codegen.sizes.SizeArgs` whose
    parameters `decl` declares). The program must ask for pointers aligned to the packs
    (`CudaProgram.alignment`). Raises ValueError where the output does not qualify
    (`vector_stores`)."""
    d = CudaDialect()
    bvar, mvar, nvar = _variables(extents)
    index = index_of(bvar, mvar, nvar)
    if not _stores(out, index, nvar, vector):
        raise ValueError(f"the output {out.shape} does not store {vector} neighbouring elements as one pack")
    names = KernelArgs.names(lowered.inputs)
    names.update({id(bvar): "b", id(mvar): "m", id(nvar): "n"})
    strides = {id(t): row_major_strides(t.shape) for t in lowered.inputs}
    em = Emitter(d, names, strides, sizes=sizes)
    first = simplify(substitute(out.value, index))
    shifted = [first] + [simplify(substitute(first, {id(nvar): nvar + k})) for k in range(1, vector)]
    for j, load in enumerate(unconditional_loads(first, nvar)):
        if not _aligned_at(_flat(load.indices, load.tensor.shape), nvar, vector) or load.tensor.shape[-1] % vector:
            continue
        pack = f"kiln_pack<{d.storage_type(load.dtype)}, {vector}>"
        at = staged_source(load, names, mvar, [nvar], sources)
        ref = f"src{at[0]}[at]" if at is not None else f"{names[id(load.tensor)]}[{em.offset(load)}]"
        em.line(f"const {pack} s{j} = *(const {pack}*)&{ref};")
        for k in range(vector):
            element = load if k == 0 else simplify(substitute(load, {id(nvar): nvar + k}))
            em.scopes[0][element.key()] = em.let(load.dtype, d.load(load.dtype, f"s{j}.v[{k}]"))
    stored = []
    for k, value in enumerate(shifted):
        em.scopes[0][top_reduces(value)[0].key()] = f"acc[{k}]"
        stored.append(d.store(out.dtype, em.emit(value)))
    offset = em.emit(_flat([index[id(a)] for a in out.axes], out.shape))
    em.line(_store(KernelArgs.output(0), offset, stored, out.dtype))
    acc_type = d.value_type(top_reduces(first)[0].dtype)
    tiles = ", int at" + "".join(f", const {d.storage_type(s.dtype)}* src{k}" for k, s in enumerate(sources)) \
        if sources else ""
    return (f"static __device__ __forceinline__ void kiln_epilogue_v({', '.join(decl)}, int64_t b, int64_t m, "
            f"int64_t n, const {acc_type}* acc{tiles}) {{\n" + "\n".join(em.lines) + "\n}\n")
