"""Aligned packs over a kernel's run of consecutive elements: which loads are *streams*, how
wide a pack is, and how it is read.

A kernel that gives each thread V consecutive elements `e` of a run (a row kernel's row, a
column kernel's outputs along their innermost dim) reads a load as one pack of V values when
the load reads element `b + e` of its tensor, `b` a multiple of V that does not change along
the run (a function of the run's fixed indices only), in bounds for every index: such a load
is a stream. A pack holds PACK_BYTES of the narrowest type packed (MAX_VECTOR values at most),
fewer where the run's length or an offset is not a multiple; the pointers a kernel reads packs
from must then be aligned to the pack (`pack_alignment`, asked of the runtime through
`CudaProgram.alignment`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from kiln import dtypes
from kiln.codegen.emitter import numel
from kiln.ir.expr import Expr, Load, Var, as_expr, walk
from kiln.ir.inline import substitute
from kiln.ir.simplify import bounds, linear_terms, simplify
from kiln.ir.size import SymSize

PACK_BYTES = 16          # the widest access: a pack of the narrowest type is this many bytes
MAX_VECTOR = 8           # elements in a pack at most


@dataclass(eq=False)
class Stream:
    """Loads of elements `base + e` of `tensor` (e: the element of the run), read as packs."""

    tensor: object
    base: Expr


def stream_offset(load: Load, strides: dict, e: Var, fixed: tuple[Var, ...]) -> tuple[Expr, int] | None:
    """(b, g) when `load` reads element b + e of its tensor, b a function of the index
    variables `fixed` only and a multiple of g, in bounds for every value of its indices;
    else None."""
    if id(load.tensor) not in strides or not load.indices:
        return None
    flat = None
    for idx, stride in zip(load.indices, strides[id(load.tensor)]):
        term = idx * stride if stride != 1 else idx
        flat = term if flat is None else flat + term
    flat = simplify(flat)
    span = bounds(flat)
    if span is None or span[0] < 0 or span[1] >= numel(load.tensor.shape):
        return None
    terms, const = linear_terms(flat)
    unit = sum(k for t, k in terms if t is e)
    rest = [(t, k) for t, k in terms if t is not e]
    if unit != 1 or any(isinstance(x, Var) and not any(x is v for v in fixed) for t, _ in rest for x in walk(t)):
        return None
    base = simplify(substitute(flat, {id(e): as_expr(0, dtypes.int64)}))
    return base, math.gcd(const, *(k for _, k in rest))


def phase_multiple(base: Expr, anchor: Expr) -> int:
    """The largest g such that `base - anchor` is a multiple of g for every value of its
    variables (0 where they are equal)."""
    terms, const = linear_terms(simplify(base - anchor))
    merged: dict = {}
    for t, k in terms:
        merged[t.key()] = merged.get(t.key(), 0) + k
    return math.gcd(const, *merged.values())


def candidate_bases(values: list[Expr], strides: dict, e: Var, fixed: tuple[Var, ...]) -> list[Expr]:
    """The bases of the loads in `values` that read element base + e of their tensor (see
    `stream_offset`), in order of first read: the anchors a phased run may take."""
    found = {}
    for value in values:
        for x in walk(value):
            if isinstance(x, Load) and x.key() not in found:
                found[x.key()] = stream_offset(x, strides, e, fixed)
    return [offset[0] for offset in found.values() if offset is not None]


def find_streams(values: list[Expr], strides: dict, e: Var, fixed: tuple[Var, ...], length,
                 packed=(), whole: bool = False, anchor: Expr | None = None) -> tuple[int, dict]:
    """The pack width V and the streams (load key -> Stream) of the loads in `values`, over a
    run of `length` elements `e` (a multiple of V; V is 1 for a symbolic length); `packed`:
    the types of the kernel's other accesses in packs of V (a row kernel's output). Loads
    whose offset is not a multiple of V stay scalar; with `whole`, none may: V halves until
    every load that depends on `e` is a stream (down to 1, and no streams). With an `anchor`
    (see the module doc), V is the widest pack whatever the length, and the streams are the
    loads whose base is in phase with the anchor."""
    found = {}
    for value in values:
        for x in walk(value):
            if isinstance(x, Load) and x.key() not in found:
                found[x.key()] = (x, stream_offset(x, strides, e, fixed))
    candidates = {key: (x, offset) for key, (x, offset) in found.items() if offset is not None}
    narrowest = min([x.tensor.dtype.nbytes for x, _ in candidates.values()] + [t.nbytes for t in packed],
                    default=PACK_BYTES)
    vector = 1 if isinstance(length, SymSize) else min(MAX_VECTOR, max(1, PACK_BYTES // narrowest))
    while anchor is None and length % vector:
        vector //= 2
    if whole:
        along = [offset for x, offset in found.values() if any(i is e for i in walk(x))]
        while vector > 1 and any(offset is None or offset[1] % vector for offset in along):
            vector //= 2
    if vector == 1 and whole:
        return 1, {}
    streams, keys = {}, {}
    for key, (load, (base, multiple)) in candidates.items():
        if anchor is not None:
            multiple = phase_multiple(base, anchor)
        if multiple % vector == 0:
            streams[key] = keys.setdefault((id(load.tensor), base.key()), Stream(load.tensor, base))
    return vector, streams


def pack_type(dialect, t, vector: int) -> str:
    """The C type of a pack of `vector` values of type `t`."""
    return f"kiln_pack<{dialect.storage_type(t)}, {vector}>"


def read_pack(dialect, stream: Stream, pointer: str, base: str, at: str, vector: int) -> str:
    """The C expression of the pack of `stream` starting at run element `at` (C expressions:
    `pointer` its tensor's, `base` the stream's base)."""
    return f"*reinterpret_cast<const {pack_type(dialect, stream.tensor.dtype, vector)}*>({pointer} + {base} + {at})"


def pack_alignment(tensors, vector: int) -> int:
    """The byte alignment that packs of `vector` values of each of `tensors` need."""
    return max((min(PACK_BYTES, t.dtype.nbytes * vector) for t in tensors), default=1) if vector > 1 else 1
