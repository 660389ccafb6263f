"""Reading an `attention` task (`kiln_ops_builtin.attention`) as a fused attention kernel sees it.

`match_attention(task)` finds, in the lowered task, the scores buffer
`S[b.., i, j] = [causal](j <= i, [mask](sum_d q[.., i, d] * k[.., j, d] * scale))` and the
output element `select(total == 0, 0, sum_j exp(S - shift) * v[.., j, e] / total)`, and returns:

- q, k and v as `Strided` operands: element (batch b.., row, col) of each at an affine offset
  of the input it reads (permuted, sliced or reshaped views fused in as index arithmetic), the
  column stride 1; grouped-query heads read key/value head h // group;
- the mask's value as the hook `kiln_mask(KILN_PARAMS, b, i, j)`, rendered by the core from
  whatever computes it (a plain tensor read, or an additive mask built by fused operators):
  a bool (keep where true) or a float32 to add;
- the scale, causality, and the output hooks `kiln_epilogue(KILN_PARAMS, b, m, n, acc)` and
  `kiln_epilogue2(..)` (`kiln.codegen.hooks.render_epilogue`), `acc` being the normalized
  attention value of query row m, column n, so a fused epilogue (a cast, a residual add)
  renders into them; for the CPU (`match_attention(task, "cpu")`) the hooks are C and the
  output hook is the row epilogue of `cpu_hooks`. The output may be written through views
  folded in after the attention: heads and rows swapped (`.transpose(1, 2)`), dims merged by a
  reshape (`.reshape(B, L, H * Dv)`), each output axis one coordinate of the attention or two.

It returns None for anything else (an operand computed by a fused prologue, strides that are
not whole 16-byte chunks on a GPU, an epilogue that splits the value column or computes with
its neighbours), and the auto-scheduler keeps the semantics.

Symbolic sizes (`kiln.ir.size.SymSize`: a sequence length, a KV cache's length, a batch) are
kernel arguments: the hooks and `Strided.base` write them through `Attention.sizes`
(`kiln.codegen.sizes.SizeArgs.of(task)`), whose parameters end `params` and `args`; Lq, Lk,
the batch dims and the strides are then `SymSize`s, which a template writes with `text` (or
`int_text` where its kernel computes with ints).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from kiln.template import (Binary, CDialect, Cast, Compute, Const, CudaDialect, DataType, Emitter, Expr, KernelArgs,
                           Load, Reduce, Select, SizeArgs, SymSize, TensorInput, Unary, Var, dtypes, inline_task,
                           render_epilogue, rewrite, row_major_strides, simplify, substitute, unravel_index, walk)

from kiln_ops_builtin.templates.cpu_hooks import render_epilogue_row, reports_failures

CHUNK = 8       # 16-bit elements per 16-byte copy: every stride but the column's a multiple of it
MASKS = {None: "NoMask", "bool": "BoolMask", "float": "FloatMask"}      # cuda/attention.cuh's kinds

# The members of a program struct through which cuda/attention*.cuh kernels read an attention task
# (`Attention.device_operands`). The flat batch index comes by reference to an operand with a batch
# offset, by value, unnamed, to one without (as matmul_tc's): otherwise NVRTC computes the offset,
# or the address of a copy that reads nothing, at another place in the kernel.
OPERANDS = """\
    enum : int {{ CAUSAL = {causal} }};
    using Mask = kiln::attention::{mask};
    static __device__ __forceinline__ float scale_log2() {{ return {scale_log2}; }}
{operands}"""
OPERAND = """\
    static __device__ __forceinline__ const {storage}* {name}(PARAMS, {bh}) {{
        return (const {storage}*){param} + ({base});
    }}
    static __device__ __forceinline__ int64_t {name}_rs(PARAMS) {{ return (int64_t){row_stride}; }}
"""


@dataclass(frozen=True)
class Strided:
    """An operand read straight from input `param`: element (b.., row, col) at
    `offset + sum(coef[f"b{k}"] * b_k) + coef["hkv"] * (b_last // group) + row * row_stride + col`."""

    param: str
    dtype: DataType
    coef: dict
    row_stride: int
    offset: int

    def batch_axes(self, batch: tuple[int, ...], group: int, text=lambda size: str(int(size))) -> list:
        """(inner, size, divisor, stride, extent) of each batch dimension the operand moves along
        (innermost first; a dim of extent 1 or stride 0 has none), its coordinate for a flat batch
        index f being f / inner % size / divisor, sizes written by `text` (`Attention.text` for
        symbolic ones): the batch dims b_k (divisor 1), and for grouped-query heads the key/value
        head b_last // group (divisor group)."""
        axes, inner = [], 1
        for k in reversed(range(len(batch))):
            if self.coef.get(f"b{k}") and batch[k] > 1:
                axes.append((text(inner), text(batch[k]), 1, self.coef[f"b{k}"], batch[k]))
            if k == len(batch) - 1 and self.coef.get("hkv") and batch[k] > 1:
                axes.append((text(inner), text(batch[k]), group, self.coef["hkv"], batch[k] // group))
            inner *= batch[k]
        return axes

    def batch_dims(self, batch: tuple[int, ...], group: int, flat: str, text=lambda size: str(int(size))) -> list:
        """(C expression of the coordinate, stride, extent) of each of `batch_axes` for the flat
        batch index `flat`."""
        dims = []
        for inner, size, divisor, stride, extent in self.batch_axes(batch, group, text):
            coordinate = f"(({flat}) / {inner} % {size})"
            dims.append((coordinate if divisor == 1 else f"({coordinate} / {divisor})", stride, extent))
        return dims

    def base(self, batch: tuple[int, ...], group: int, flat: str, text=lambda size: str(int(size))) -> str:
        """C expression of the element offset of row 0, column 0 for the flat batch index `flat`,
        sizes written by `text` (`Attention.text` for symbolic ones)."""
        terms = [text(self.offset)] if self.offset else []
        terms += [f"{c} * (int64_t){text(stride)}" for c, stride, _ in self.batch_dims(batch, group, flat, text)]
        return " + ".join(terms) or "0"


@dataclass
class Attention:
    """What a fused attention kernel needs to know of an attention task."""

    dtype: DataType             # q's (k's and v's may differ: the template checks)
    batch: tuple[int, ...]      # the scores' batch dims (leading dims, then query heads)
    group: int                  # query heads per key/value head
    Lq: int
    Lk: int
    D: int
    Dv: int
    q: Strided
    k: Strided
    v: Strided
    scale: float
    causal: bool
    mask: str | None            # None, "bool" or "float"
    params: str                 # buffers, then sizes
    args: str
    hooks: str                  # kiln_mask (with a mask), kiln_epilogue, kiln_epilogue2
    sizes: SizeArgs

    @property
    def batch_count(self) -> int:
        return math.prod(self.batch)

    def text(self, size) -> str:
        """C text of a size (an int64 expression of the size parameters where symbolic)."""
        return self.sizes.text(size)

    def int_text(self, size) -> str:
        """C text of a size as an int: a symbolic size's expression cast to int (a length
        the kernel counts in ints, as it would a literal)."""
        return f"((int){self.sizes.text(size)})" if isinstance(size, SymSize) else str(int(size))

    def base(self, operand: Strided, flat: str) -> str:
        """`operand`'s `Strided.base` for the flat batch index `flat`."""
        return operand.base(self.batch, self.group, flat, self.text)

    def batch_axes(self, operand: Strided) -> list:
        """`operand`'s `Strided.batch_axes`."""
        return operand.batch_axes(self.batch, self.group, self.text)

    def device_defines(self) -> dict:
        """The #defines a cuda/attention*.cuh kernel reads besides its program: the kernel's
        parameters and arguments (PARAMS, ARGS), the query and key lengths (LQ, LK: ints)."""
        return {"PARAMS": self.params, "ARGS": self.args, "LQ": self.int_text(self.Lq), "LK": self.int_text(self.Lk)}

    def device_operands(self, storage: str) -> str:
        """The members of a program struct through which a cuda/attention*.cuh kernel reads
        this task, its operands' elements being `storage`: CAUSAL, Mask (the mask's kind, a
        type of cuda/attention.cuh), scale_log2() (the scale in the log2 domain), and for q, k
        and v a pointer to row 0 of flat batch bh (`q(PARAMS, bh)`) and the row stride
        (`q_rs(PARAMS)`), PARAMS being `device_defines`' macro."""
        operands = "".join(OPERAND.format(storage=storage, name=name, param=op.param, base=base,
                                          bh="int64_t" if base == "0" else "const int64_t& bh",
                                          row_stride=self.text(op.row_stride))
                           for name, op in (("q", self.q), ("k", self.k), ("v", self.v))
                           for base in [self.base(op, "bh")])
        return OPERANDS.format(causal=int(self.causal), mask=MASKS[self.mask],
                               scale_log2=f"{self.scale * math.log2(math.e)!r}f", operands=operands)


def _affine(e: Expr, roles: dict[int, str], group: int, head: int | None) -> dict | None:
    """`e` as {role: coefficient, "": constant}, or None when it is not affine in the roles'
    variables (`head // group` counts as the role "hkv")."""
    if isinstance(e, Const) and isinstance(e.value, int):
        return {"": e.value}
    if isinstance(e, Var):
        return {roles[id(e)]: 1} if id(e) in roles else None
    if not isinstance(e, Binary):
        return None
    if e.op == "floordiv" and isinstance(e.a, Var) and id(e.a) == head and isinstance(e.b, Const) \
            and e.b.value == group:
        return {"hkv": 1}
    if e.op in ("add", "sub"):
        a, b = _affine(e.a, roles, group, head), _affine(e.b, roles, group, head)
        if a is None or b is None:
            return None
        sign = 1 if e.op == "add" else -1
        return {r: a.get(r, 0) + sign * b.get(r, 0) for r in set(a) | set(b)}
    if e.op == "mul":
        for x, y in ((e.a, e.b), (e.b, e.a)):
            if isinstance(y, Const) and isinstance(y.value, int):
                a = _affine(x, roles, group, head)
                return None if a is None else {r: c * y.value for r, c in a.items()}
    return None


def _strided(e: Expr, params: dict, roles: dict[int, str], row: str, col: str, group: int,
             head: int | None, chunk: int) -> Strided | None:
    """`e` (a cast of) a load of a task input as a `Strided` operand with rows `row` and unit-stride
    columns `col`, every other stride and the offset multiples of `chunk` elements, or None."""
    load = e.a if isinstance(e, Cast) else e
    if not isinstance(load, Load) or not isinstance(load.tensor, TensorInput) or id(load.tensor) not in params:
        return None
    flat: dict = {}
    for index, stride in zip(load.indices, row_major_strides(load.tensor.shape)):
        a = _affine(index, roles, group, head)
        if a is None:
            return None
        for r, c in a.items():
            flat[r] = flat.get(r, 0) + c * stride
    allowed = {"", row, col, "hkv"} | {r for r in roles.values() if r.startswith("b")}
    if set(flat) - allowed or flat.get(col) != 1:
        return None
    coef = {r: c for r, c in flat.items() if r not in ("", row, col) and c}
    if any(c % chunk or c < 0 for c in coef.values()) or flat.get(row, 0) % chunk or flat.get("", 0) % chunk:
        return None
    return Strided(params[id(load.tensor)], load.tensor.dtype, coef, flat.get(row, 0), flat.get("", 0))


def _is_const(e: Expr, value: float) -> bool:
    return isinstance(e, Const) and e.value == value


def _peel_scores(value: Expr, axes, causal: bool):
    """(dot-product reduce, scale, mask kind, mask expression) of the scores' value, or None."""
    i, j = axes[-2], axes[-1]
    if causal:
        if not (isinstance(value, Select) and _is_const(value.b, -math.inf) and isinstance(value.cond, Binary)
                and value.cond.op == "le" and value.cond.a is j and value.cond.b is i):
            return None
        value = value.a
    kind, mask = None, None
    if isinstance(value, Select) and _is_const(value.b, -math.inf):
        kind, mask, value = "bool", value.cond, value.a
    elif isinstance(value, Binary) and value.op == "add":
        kind, mask, value = "float", value.b, value.a
    scale = 1.0
    if isinstance(value, Binary) and value.op == "mul" and isinstance(value.b, Const):
        value, scale = value.a, value.b.value
    if not (isinstance(value, Reduce) and value.op == "sum" and len(value.axes) == 1):
        return None
    if mask is not None and any(isinstance(x, Reduce) or (isinstance(x, Load) and not isinstance(x.tensor, TensorInput))
                                for x in walk(mask)):
        return None
    return value, scale, kind, mask


def _find_element(value: Expr) -> Select | None:
    """The attention element `select(total == 0, 0, weighted / total)` inside an output's value, or None."""
    for e in walk(value):
        if (isinstance(e, Select) and isinstance(e.cond, Binary) and e.cond.op == "eq"
                and isinstance(e.cond.a, Load) and _is_const(e.cond.b, 0.0) and _is_const(e.a, 0.0)
                and isinstance(e.b, Binary) and e.b.op == "div" and isinstance(e.b.a, Reduce)
                and isinstance(e.b.b, Load) and e.b.b.key() == e.cond.a.key()):
            return e
    return None


def _part(e: Expr, axes: dict) -> tuple | None:
    """(output axis, how, K) where index `e` is that axis itself ("=", None), `axis // K` or
    `axis % K`; ("0", None, None) for the constant 0; None for anything else."""
    if isinstance(e, Var) and id(e) in axes:
        return axes[id(e)], "=", None
    if isinstance(e, Binary) and e.op in ("floordiv", "mod") and isinstance(e.a, Var) and id(e.a) in axes \
            and isinstance(e.b, Const) and isinstance(e.b.value, int) and e.b.value > 0:
        return axes[id(e.a)], e.op, e.b.value
    return (None, "0", None) if _is_const(e, 0) else None


def _coordinates(out: Compute, row, row_extents) -> tuple[list[Var], dict, bool] | None:
    """The attention's coordinates (batch.., query i, value column e) as new index variables,
    the output's axes (by id) as expressions of them, and whether consecutive columns are
    neighbours in the output -- or None. The element's row indices `row` (of extents
    `row_extents`) are each an output axis, `axis // K` or `axis % K` (an output that merged
    dims by a reshape, `attention(..).transpose(1, 2).reshape(B, L, H * Dv)`); the column is the
    output axis they leave over, or `axis % K` beside a row's `axis // K`. The map must invert:
    substituted into every row index and the column it gives back their variables."""
    axes = {id(a): a for a in out.axes}
    parts = [_part(e, axes) for e in row]
    if None in parts:
        return None
    used = {id(a) for a, _, _ in parts if a is not None}
    divided = [(a, k) for a, how, k in parts if how == "floordiv"
               and not any(b is a and h == "mod" for b, h, _ in parts)]
    left = [a for a in out.axes if id(a) not in used and a.extent != 1]
    if len(divided) == 1 and not left:
        column = (divided[0][0], "mod", divided[0][1])
    elif not divided and len(left) <= 1:
        last = out.axes[-1]
        column = (left[0], "=", None) if left else (last, "=", None) if id(last) not in used else None
    else:
        return None
    if column is None:
        return None
    parts.append(column)
    extents = list(row_extents) + [column[2] if column[1] == "mod" else column[0].extent]
    coords = [Var(f"c{k}", x) for k, x in enumerate(extents)]
    to_out = {}
    for a in out.axes:
        mine = {how: (k, size) for k, (b, how, size) in enumerate(parts) if b is a}
        if set(mine) == {"="}:
            to_out[id(a)] = coords[mine["="][0]]
        elif set(mine) == {"floordiv", "mod"} and mine["floordiv"][1] == mine["mod"][1] == extents[mine["mod"][0]]:
            to_out[id(a)] = coords[mine["floordiv"][0]] * mine["mod"][1] + coords[mine["mod"][0]]
        elif not mine and a.extent == 1:
            to_out[id(a)] = Const(0, dtypes.int64)
        else:
            return None
    back = [simplify(substitute(e, to_out)) for e in list(row) + [_index(parts[-1])]]
    if any(b is not c and x != 1 for b, c, x in zip(back, coords, extents)):
        return None
    neighbours = column[0] is out.axes[-1] and (column[1] == "=" or column[2] % 2 == 0)
    return coords, to_out, neighbours


def _index(part) -> Expr:
    axis, how, k = part
    return axis if how == "=" else axis % k


def match_attention(task, target: str = "cuda") -> Attention | None:
    """The attention `task` computes as a fused kernel of `target` sees it (see the module doc),
    or None. For "cuda" the hooks are device functions and the operands' strides whole 16-byte
    chunks; for "cpu" the hooks are C (`kiln_mask`, and `cpu_hooks.render_epilogue_row`'s
    `kiln_epilogue_row(KILN_PARAMS, b, m, n0, count, acc)` for row m of flat batch b, value
    columns n0 .. n0 + count - 1) and the strides any. Matched once per task and target."""
    return task.derived(_match, target)


def _match(task, target: str) -> Attention | None:
    lowered = inline_task(task)
    if len(lowered.outputs) != 1 or len(lowered.buffers) != 4:
        return None
    out = lowered.outputs[0]
    element = _find_element(out.value)
    if (element is None or not isinstance(element.cond.a.tensor, Compute)
            or target == "cpu" and reports_failures(out.value)):
        return None
    found = _coordinates(out, element.cond.a.indices, element.cond.a.tensor.shape)
    if found is None:
        return None
    coords, to_out, neighbours = found
    # the output's value over the attention's coordinates: the attention as if written plainly
    seen = _find_element(simplify(substitute(out.value, to_out)))
    if seen is None:
        return None
    row, column = coords[:-1], coords[-1]
    weighted, total = seen.b.a, seen.cond.a.tensor
    body = weighted.body
    if not (weighted.op == "sum" and len(weighted.axes) == 1 and isinstance(body, Binary) and body.op == "mul"
            and isinstance(body.a, Unary) and body.a.op == "exp" and isinstance(body.a.a, Binary)
            and isinstance(body.a.a.a, Load)):
        return None
    scores = body.a.a.a.tensor
    if not (isinstance(scores, Compute) and isinstance(total, Compute) and isinstance(total.value, Reduce)
            and total.value.op == "sum" and scores.shape[:-1] == total.shape):
        return None
    batch, (Lq, Lk), Dv = scores.shape[:-2], scores.shape[-2:], column.extent
    peeled = _peel_scores(scores.value, scores.axes, bool(task.attrs.get("is_causal")))
    if peeled is None:
        return None
    dot, scale, kind, mask = peeled
    prod = dot.body
    if not (isinstance(prod, Binary) and prod.op == "mul"):
        return None
    params = KernelArgs.names(lowered.inputs)
    head = id(scores.axes[-3]) if len(batch) else None
    # the group from k's head index (h // group); 1 without one
    group = next((int(x.b.value) for x in walk(prod) if isinstance(x, Binary) and x.op == "floordiv"
                  and isinstance(x.b, Const)), 1)
    roles = {id(a): f"b{n}" for n, a in enumerate(scores.axes[:-2])}
    roles.update({id(scores.axes[-2]): "i", id(scores.axes[-1]): "j", id(dot.axes[0]): "d"})
    chunk = CHUNK if target == "cuda" else 1
    q = _strided(prod.a, params, roles, "i", "d", group, head, chunk)
    k = _strided(prod.b, params, roles, "j", "d", group, head, chunk)
    out_roles = {id(a): f"b{n}" for n, a in enumerate(row[:-1])}
    out_roles.update({id(weighted.axes[0]): "j", id(column): "e"})
    v = _strided(body.b, params, out_roles, "j", "e", group, id(row[-2]) if len(batch) else None, chunk)
    if q is None or k is None or v is None or tuple(a.extent for a in row) != batch + (Lq,):
        return None
    D = dot.axes[0].extent
    d = CudaDialect() if target == "cuda" else CDialect()
    sizes = SizeArgs.of(task)
    decl = KernelArgs.params(d, lowered.inputs, [out]) + sizes.declarations()
    hooks = ""
    if mask is not None:
        hooks = _mask_hook(mask, scores, decl, lowered, d, sizes)
    plain = Compute(out.name, out.axes, rewrite(out.value, pre=lambda e: element.b.a if e is element else None))

    def index_of(bvar, mvar, nvar):
        at = {**unravel_index(bvar, row[:-1], batch), id(row[-1]): mvar, id(column): nvar}
        return {k: simplify(substitute(e, at)) for k, e in to_out.items()}

    if target == "cuda":
        hooks += render_epilogue(lowered, plain, decl, index_of, neighbours, sizes=sizes)
    else:
        bvar, mvar, nvar = Var("b", math.prod(batch)), Var("m", Lq), Var("n", Dv)
        hooks += render_epilogue_row(lowered, plain, index_of(bvar, mvar, nvar),
                                     {id(bvar): "b", id(mvar): "m", id(nvar): "n"}, ", ".join(decl), sizes)
    return Attention(q.dtype, batch, group, Lq, Lk, D, Dv, q, k, v, scale, bool(task.attrs.get("is_causal")), kind,
                     ", ".join(decl), ", ".join(KernelArgs.args(len(lowered.inputs)) + sizes.names), hooks, sizes)


def _mask_hook(mask: Expr, scores: Compute, decl: list[str], lowered, d, sizes: SizeArgs) -> str:
    """`kiln_mask(params, b, i, j)` in dialect `d`: the mask's value at the scores' flat batch b,
    row i, column j."""
    bvar, ivar, jvar = Var("b", 1 << 62), Var("i", 1 << 62), Var("j", 1 << 62)
    index = {**unravel_index(bvar, scores.axes[:-2], scores.shape[:-2]), id(scores.axes[-2]): ivar,
             id(scores.axes[-1]): jvar}
    names = {**KernelArgs.names(lowered.inputs), id(bvar): "b", id(ivar): "i", id(jvar): "j"}
    em = Emitter(d, names, {id(t): row_major_strides(t.shape) for t in lowered.inputs}, sizes=sizes)
    value = em.emit(simplify(substitute(mask, index)))
    head = "static __device__ __forceinline__" if isinstance(d, CudaDialect) else "static inline"
    return (f"{head} {d.value_type(mask.dtype)} kiln_mask({', '.join(decl)}, "
            f"int64_t b, int64_t i, int64_t j) {{\n" + "\n".join(em.lines) + f"\n    return {value};\n}}\n")
