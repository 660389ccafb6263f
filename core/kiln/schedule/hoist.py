"""Costly parts of a reduction's body that are the same for several elements of its buffer
become temporaries of their own, so they are computed once instead of once per element.

Attention's output `out[b, i, e] = sum_j exp(s[b, i, j] - m[b, i]) * v[b, j, e] / t[b, i]`
evaluates exp(s[b, i, j] - m[b, i]) again for every `e`: the buffer's loop over `e` encloses
the reduction over `j`, and inlining (`kiln.ir.inline`) put the exponential in its body. Here
each such part becomes a temporary over the indices it reads (the buffer's axes, or the
coarser index `axis // c` where it reads only that, as after a reshape that merged heads and
head dims, and the reduction's axes), written before the buffer; the body reads it back, a
multiply-add loop over j. A part qualifies where it is costly, reads a reduction axis, lies
outside any branch of the body that runs for some elements only, reads memory only where every
index is in bounds, and its temporary holds at most half as many values as the buffer computes
(and HOIST_MAX_BYTES).
"""
from __future__ import annotations

from kiln.codegen.emitter import numel, row_major_strides
from kiln.ir.compute import Compute
from kiln.ir.expr import Binary, Check, Const, Expr, Load, Reduce, Select, Unary, Var, walk
from kiln.ir.inline import Lowered, own_children, rebuild_expr, substitute
from kiln.ir.simplify import bounds, simplify
from kiln.schedule.rows import CHEAP_OPS

HOIST_MAX_BYTES = 1 << 28


def _costly(x: Expr) -> bool:
    return any(isinstance(y, (Unary, Binary)) and y.op not in CHEAP_OPS for y in walk(x))


def _in_bounds(load: Load) -> bool:
    """Whether `load` reads inside its tensor for every value of its index variables (a part
    computed for all of them may have been guarded by a condition around its reduction)."""
    if not load.indices:
        return True
    flat = None
    for idx, stride in zip(load.indices, row_major_strides(load.tensor.shape)):
        flat = idx * stride if flat is None else flat + idx * stride
    span = bounds(simplify(flat))
    return span is not None and span[0] >= 0 and span[1] < numel(load.tensor.shape)


def _index_of(part: Expr, axis: Var) -> tuple[Expr, int]:
    """(the index of `axis` that `part` reads, its extent): `axis // c` where every read of
    `axis` is that, else `axis` itself."""
    parents = [y for y in walk(part) if any(k is axis for k in y.children())]
    first = parents[0] if parents else None
    if first is not None and all(
            isinstance(y, Binary) and y.op == "floordiv" and y.a is axis and isinstance(y.b, Const)
            and y.b.value > 1 and y.b.key() == first.b.key() for y in parents):
        return first, -(-axis.extent // first.b.value)
    return axis, axis.extent


def _indices(part: Expr, buffer_axes: list[Var], reduce_axes: tuple) -> list[tuple[Expr, int]] | None:
    """The indices (and extents) of the temporary of `part` (see the module doc), or None
    where it is not worth one."""
    used = {id(v) for v in walk(part) if isinstance(v, Var)}
    scope = list(buffer_axes) + list(reduce_axes)
    if not used <= {id(a) for a in scope} or any(not isinstance(a.extent, int) for a in scope):
        return None
    indices = [_index_of(part, a) if k < len(buffer_axes) else (a, a.extent)
               for k, a in enumerate(scope) if id(a) in used]
    size = numel([extent for _, extent in indices])
    if 2 * size > numel([a.extent for a in scope]) or size * part.dtype.nbytes > HOIST_MAX_BYTES:
        return None
    return indices


def _invariant_parts(body: Expr, buffer_axes: list[Var], reduce_axes: tuple) -> list[Expr]:
    """The largest parts of `body` worth a temporary (see the module doc)."""
    reduce_ids = {id(a) for a in reduce_axes}
    found, seen = [], set()

    def visit(x):
        if id(x) in seen or isinstance(x, (Const, Var, Load, Reduce, Check)):
            return
        seen.add(id(x))
        if isinstance(x, Select):
            visit(x.cond)
            return
        used = {id(v) for v in walk(x) if isinstance(v, Var)}
        if (_costly(x) and used & reduce_ids
                and not any(isinstance(y, (Reduce, Check)) or (isinstance(y, Load) and not _in_bounds(y))
                            for y in walk(x))
                and _indices(x, buffer_axes, reduce_axes) is not None):
            found.append(x)
            return
        for k in x.children():
            visit(k)

    visit(body)
    return found


def _replace(e: Expr, parts: dict) -> Expr:
    """`e` with each sub-expression whose key is in `parts` replaced by its value there."""
    memo = {}

    def visit(x):
        if id(x) not in memo:
            if x.key() in parts:
                memo[id(x)] = parts[x.key()]
            elif isinstance(x, (Var, Const)) or not x.children():
                memo[id(x)] = x
            else:
                memo[id(x)] = rebuild_expr(x, [visit(k) for k in own_children(x)])
        return memo[id(x)]

    return visit(e)


def _temporary(part: Expr, indices: list[tuple[Expr, int]], name: str) -> tuple[Compute, Load]:
    """The temporary computing `part` over `indices`, and the load reading it back."""
    fresh = [Var(f"h{k}", extent) for k, (_, extent) in enumerate(indices)]
    coarse = {index.key(): f for (index, _), f in zip(indices, fresh) if not isinstance(index, Var)}
    plain = {id(index): f for (index, _), f in zip(indices, fresh) if isinstance(index, Var)}
    temp = Compute(name, fresh, simplify(substitute(_replace(part, coarse), plain)))
    return temp, Load(temp, [index for index, _ in indices])


def hoist_invariants(lowered: Lowered) -> Lowered:
    """`lowered` with the costly parts of its buffers' reductions that are the same for
    several elements (see the module doc) made temporaries written before them; `lowered`
    itself where there are none."""
    buffers: list[Compute] = []
    renamed: dict[int, Compute] = {}         # buffer (by id) -> its rewritten version
    for orig in lowered.buffers:
        value = substitute(orig.value, {}, loads=renamed) if renamed else orig.value
        parts: dict = {}
        for r in [x for x in walk(value) if isinstance(x, Reduce)]:
            for part in _invariant_parts(r.body, list(orig.axes), r.axes):
                if part.key() not in parts:
                    temp, load = _temporary(part, _indices(part, list(orig.axes), r.axes),
                                            f"{orig.name}_part{len(parts)}")
                    buffers.append(temp)
                    parts[part.key()] = load
        if parts:
            value = _replace(value, parts)
        if value is not orig.value:
            renamed[id(orig)] = Compute(orig.name, orig.axes, value)
        buffers.append(renamed.get(id(orig), orig))
    if not renamed:
        return lowered
    return Lowered(lowered.task, buffers, [renamed.get(id(o), o) for o in lowered.outputs])
