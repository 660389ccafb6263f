"""Fusion hooks of templates: the parts of a template's kernel the core renders from the IR.

A contraction template (matmul, batched matmul, linear, convolution as implicit GEMM) computes
`acc[b, m, n] = sum_k A[b, m, k] * B[b, k, n]` with its own tiling, and never spells how an
output element is made from `acc`, nor where it goes: it calls the epilogue hook

    kiln_epilogue(KILN_PARAMS, b, m, n, acc)

which the core renders from the output's compute definition (`kiln.codegen.epilogue`: the
element's value with its reduction replaced by `acc`, whatever fusion put there) and which
stores the element.

Operands come two ways. `match_contraction` describes plain loads of inputs by `Operand`
(buffer and strides), which a template reads with its own vectorized copies (cp.async,
float4). `match_hooked_gemm` takes any sum of a product (convolutions, with their padding)
and also renders the load hooks `kiln_load_a(KILN_PARAMS, m, k)` and
`kiln_load_b(KILN_PARAMS, k, n)`, where a prologue would go.

Symbolic sizes (`kiln.ir.size`): both matchers take tasks whose sizes are `SymSize`s and write
every size through the match's `sizes` (`kiln.codegen.sizes.SizeArgs.of(task)`: the task's size
variables, numbered before anything is rendered), whose parameters end the kernel parameter
list (`params`, `args`); a template writes its own sizes with `text(size)` (a fixed size's
digits, a symbolic one's expression over the parameters) and puts `sizes.values` in its
program. An operand's strides, M, N, K and the batch dims are then `SymSize`s where they vary.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable

from kiln.codegen.cuda import CudaDialect
from kiln.codegen.emitter import Emitter, KernelArgs, row_major_strides
from kiln.codegen.epilogue import EpilogueOutput, EpilogueSource, contraction_epilogue, offset_coefficients
from kiln.codegen.sizes import SizeArgs
from kiln.dtypes import DataType
from kiln.ir.compute import Task
from kiln import dtypes
from kiln.ir.expr import Cast, Const, Expr, Load, Reduce, Select, Var, cast, select, top_reduces, walk
from kiln.ir.index import unravel
from kiln.ir.inline import inline_task, substitute
from kiln.ir.simplify import simplify


@dataclass(frozen=True)
class Operand:
    """A contraction operand read straight from an input buffer.

    Element (b, x, k) sits at `sum(b_d * batch_strides[d]) + x * x_stride + k * k_stride`,
    where x is m for A and n for B.
    """

    param: str
    dtype: DataType
    batch_strides: tuple[int, ...]
    x_stride: int
    k_stride: int

    def strides_multiple_of(self, n: int) -> bool:
        """Whether every stride but the unit ones is a multiple of `n` elements (views fused
        before a GEMM may give other strides than K and N)."""
        return all(s % n == 0 for s in (self.x_stride, self.k_stride, *self.batch_strides) if s != 1)

    @property
    def k_contiguous(self) -> bool:
        return self.k_stride == 1

    @property
    def x_contiguous(self) -> bool:
        return self.x_stride == 1


@dataclass(frozen=True)
class Contraction:
    """A task of the form out[batch..., m, n] = epilogue(sum_k A[.., m, k] * B[.., k, n])."""

    batch: tuple[int, ...]
    M: int
    N: int
    K: int
    a: Operand
    b: Operand
    acc_dtype: DataType
    out_dtype: DataType
    params: str             # the kernel's parameter list: buffers, then sizes
    args: str               # the same names, to pass them on
    sizes: SizeArgs         # the symbolic sizes, the last parameters
    rendered: Callable[[], tuple[str, tuple[EpilogueSource, ...], EpilogueOutput]] = field(repr=False,
                                                                                          compare=False)
    """Renders (epilogue, sources, output) when first asked: a template deciding whether it
    applies reads the operands only, and fusion asks that of many candidate groups."""

    @functools.cached_property
    def _epilogue(self) -> tuple[str, tuple[EpilogueSource, ...], EpilogueOutput]:
        return self.rendered()

    @property
    def epilogue(self) -> str:
        """Source of the kiln_epilogue and kiln_epilogue2 device functions."""
        return self._epilogue[0]

    @property
    def sources(self) -> tuple[EpilogueSource, ...]:
        """What the epilogue reads per element, which a template may stage (`contraction_epilogue`)."""
        return self._epilogue[1]

    @property
    def output(self) -> EpilogueOutput:
        """What the epilogue's hooks were rendered from."""
        return self._epilogue[2]

    @property
    def batch_count(self) -> int:
        n = 1
        for s in self.batch:
            n *= s
        return n

    def text(self, size) -> str:
        """C text of a size of the contraction (see `kiln.codegen.sizes.SizeArgs.text`)."""
        return self.sizes.text(size)

    def batch_offset(self, operand: Operand, flat: str) -> str:
        """C expression of `operand`'s offset for the flat batch index `flat`."""
        terms, inner = [], 1
        for size, stride in reversed(list(zip(self.batch, operand.batch_strides))):
            if stride and size > 1:
                terms.append(f"(({flat}) / {self.text(inner)} % {self.text(size)}) * (int64_t){self.text(stride)}")
            inner *= size
        return " + ".join(terms) or "0"


def strip_cast(e: Expr) -> Expr:
    """`e` without an outer cast."""
    return e.a if isinstance(e, Cast) else e


def _rows(own: list[tuple[Var, int]]) -> tuple[int, list[tuple[Var, int]], list[Var]]:
    """Split the variables only one operand uses, with their offset coefficients, into one GEMM
    dimension (x) and batch dimensions: (x's stride, [(v, multiplier)] with x = sum(multiplier *
    v) in mixed radix, [batch variables]). Smallest coefficient first, a variable joins x where
    its coefficient is the stride of x's extent so far."""
    chain, rest, stride, extent = [], [], 0, 1
    for v, c in sorted(own, key=lambda vc: vc[1]):
        if not chain:
            stride = c
        if c == stride * extent:
            chain.append((v, extent))
            extent *= v.extent
        else:
            rest.append(v)
    return stride, chain, rest


def match_contraction(task: Task) -> Contraction | None:
    """The contraction `task` computes, or None when it is not one (or its operands are not
    plain loads of its inputs). Matched once per task (`Task.derived`).

    The output's index variables (of extent > 1) sort into three kinds by the operands that read
    with them: both (batch dimensions), A only (GEMM rows m) or B only (columns n); B is the
    operand that reads with the output's last axis (the second factor where that axis has
    extent 1). The variables of each of m and n
    form one mixed-radix number over the operand's memory (a linear's (batch, row) merge into m),
    so an output written permuted or reshaped (`linear(x).view(b, s, h, d).transpose(1, 2)`)
    is the same GEMM, its epilogue storing each element where the output wants it."""
    return task.derived(_match)


def _match(task: Task) -> Contraction | None:
    lowered = inline_task(task)
    if len(lowered.buffers) != 1 or len(lowered.outputs) != 1:
        return None
    out = lowered.outputs[0]
    if len(out.shape) < 2:
        return None
    reduces = top_reduces(out.value)
    if len(reduces) != 1 or reduces[0].op != "sum" or len(reduces[0].axes) != 1:
        return None
    r = reduces[0]
    k = r.axes[0]
    body = strip_cast(r.body)
    if getattr(body, "op", None) != "mul" or not isinstance(k.extent, int):
        return None
    x, y = strip_cast(body.a), strip_cast(body.b)
    if not (isinstance(x, Load) and isinstance(y, Load)) or x.dtype != y.dtype:
        return None
    params = KernelArgs.names(lowered.inputs)
    coefs = [offset_coefficients(x), offset_coefficients(y)]
    if None in coefs or id(x.tensor) not in params or id(y.tensor) not in params:
        return None
    axes = [a for a in out.axes if a.extent != 1]
    known = {id(a) for a in axes} | {id(k)}
    if any(i not in known for c in coefs for i in c) or any(id(k) not in c for c in coefs) \
            or any(all(id(a) not in c for c in coefs) for a in axes):
        return None
    if axes and axes[-1] is out.axes[-1] and id(axes[-1]) in coefs[0] and id(axes[-1]) not in coefs[1]:
        (x, y), coefs = (y, x), coefs[::-1]
    ca, cb = coefs
    own = lambda mine, other: [mine[id(a)] for a in axes if id(a) in mine and id(a) not in other]
    (a_stride, m_chain, a_batch), (b_stride, n_chain, b_batch) = _rows(own(ca, cb)), _rows(own(cb, ca))
    loose = {id(v) for v in a_batch + b_batch}
    batch = [a for a in axes if (id(a) in ca and id(a) in cb) or id(a) in loose]
    M, N, K = _prod(v.extent for v, _ in m_chain), _prod(v.extent for v, _ in n_chain), k.extent
    # a single row (M = 1) or column (N = 1) has any stride; this one keeps the K-major or MN-major layout
    a_stride = a_stride or (K if ca[id(k)][1] == 1 else 1)
    b_stride = b_stride or (K if cb[id(k)][1] == 1 else 1)
    operand = lambda load, c, stride: Operand(params[id(load.tensor)], load.tensor.dtype,
                                              tuple(c.get(id(v), (v, 0))[1] for v in batch), stride, c[id(k)][1])
    d = CudaDialect()
    sizes = SizeArgs.of(task)
    decl = KernelArgs.params(d, lowered.inputs, [out]) + sizes.declarations()

    def index_of(bvar, mvar, nvar):
        index = {id(a): Const(0, dtypes.int64) for a in out.axes}
        index.update(unravel_index(bvar, batch, [v.extent for v in batch]))
        for var, chain in ((mvar, m_chain), (nvar, n_chain)):
            index.update({id(v): simplify((var // mult) % v.extent) for v, mult in chain})
        return index

    n_contiguous = bool(axes) and bool(n_chain) and n_chain[0][0] is axes[-1] and axes[-1] is out.axes[-1]
    extents = (_prod(v.extent for v in batch), M, N)
    return Contraction(tuple(v.extent for v in batch), M, N, K, operand(x, ca, a_stride), operand(y, cb, b_stride),
                       r.dtype, out.dtype, ", ".join(decl),
                       ", ".join(KernelArgs.args(len(lowered.inputs)) + sizes.names), sizes,
                       lambda: contraction_epilogue(lowered, out, decl, index_of, n_contiguous, extents, sizes))


def unravel_index(var: Var, axes, extents) -> dict:
    """Index expressions of `axes` (row-major over `extents`) from the flat index `var`, by id."""
    return dict(zip(map(id, axes), unravel(var, extents)))


@dataclass
class HookedGemm:
    """Any task out[...] = epilogue(sum_r A(...) * B(...)) seen as a GEMM through hooks: GEMM
    row m enumerates the output axes only A's factor uses (row-major), column n those only B's
    uses, and k the reduction axes. The core renders `kiln_load_a(params, m, k)`,
    `kiln_load_b(params, k, n)` (each factor's value, in the accumulator type, padding and
    index arithmetic included) and the epilogues; the template only tiles."""

    M: int
    N: int
    K: int
    acc_dtype: DataType
    params: str             # the kernel's parameter list: buffers, then sizes
    args: str
    hooks: str
    sizes: SizeArgs         # the symbolic sizes, the last parameters
    sources: tuple[EpilogueSource, ...] = ()
    output: EpilogueOutput | None = None

    def text(self, size) -> str:
        """C text of a size of the GEMM (see `kiln.codegen.sizes.SizeArgs.text`)."""
        return self.sizes.text(size)


def variables_of(e: Expr) -> set[int]:
    """The ids of the index variables `e` uses."""
    return {id(x) for x in walk(e) if isinstance(x, Var)}


def gemm_factors(body: Expr, out_axes: set[int]):
    """(a, b) with body == a * b (the body of a contraction's sum, casts stripped); a guard `select(c, x * y, 0)` (zero padding) moves onto the
    factor whose output axes cover the condition's. None when body is neither."""
    if isinstance(body, Select) and isinstance(body.b, Const) and body.b.value == 0:
        inner = strip_cast(body.a)
        if getattr(inner, "op", None) != "mul":
            return None
        cond = variables_of(body.cond) & out_axes
        x, y = inner.a, inner.b
        if cond <= variables_of(x):
            return select(body.cond, x, 0), y
        if cond <= variables_of(y):
            return x, select(body.cond, y, 0)
        return None
    return (body.a, body.b) if getattr(body, "op", None) == "mul" else None


def match_hooked_gemm(task: Task) -> HookedGemm | None:
    """`task` as a GEMM through load hooks (convolutions, matmul), or None when its single
    output is not one sum of a product whose factors use disjoint output axes."""
    lowered = inline_task(task)
    if len(lowered.buffers) != 1 or len(lowered.outputs) != 1:
        return None
    out = lowered.outputs[0]
    reduces = top_reduces(out.value)
    if len(reduces) != 1 or reduces[0].op != "sum" or any(not isinstance(a.extent, int) for a in reduces[0].axes):
        return None
    r = reduces[0]
    axes = list(out.axes)
    factors = gemm_factors(strip_cast(r.body), {id(a) for a in axes})
    if factors is None or any(isinstance(x, Reduce) for x in walk(r.body) if x is not r):
        return None
    fa, fb = factors
    uses_a, uses_b = variables_of(fa), variables_of(fb)
    if any(id(a) in uses_a and id(a) in uses_b for a in axes):
        return None
    n_axes = [a for a in axes if id(a) in uses_b]
    m_axes = [a for a in axes if id(a) not in uses_b]
    if not n_axes or not any(id(a) in uses_a for a in axes):
        return None
    shape = dict(zip(map(id, axes), out.shape))
    m_ext, n_ext = [shape[id(a)] for a in m_axes], [shape[id(a)] for a in n_axes]
    k_ext = [a.extent for a in r.axes]
    M, N, K = (_prod(m_ext), _prod(n_ext), _prod(k_ext))
    d = CudaDialect()
    sizes = SizeArgs.of(task)
    decl = KernelArgs.params(d, lowered.inputs, [out]) + sizes.declarations()
    names = KernelArgs.names(lowered.inputs)
    strides = {id(t): row_major_strides(t.shape) for t in lowered.inputs}
    mvar, nvar, kvar = Var("m", M), Var("n", N), Var("k", K)
    k_index = unravel_index(kvar, r.axes, k_ext)
    loads = []
    for name, factor, own_axes, own_ext, own_var, order in (
            ("kiln_load_a", fa, m_axes, m_ext, mvar, "m, k"), ("kiln_load_b", fb, n_axes, n_ext, nvar, "k, n")):
        index = {**unravel_index(own_var, own_axes, own_ext), **k_index}
        value = simplify(cast(substitute(factor, index), r.dtype))
        em = Emitter(d, {**names, id(own_var): order[0] if own_var is mvar else "n", id(kvar): "k"}, strides,
                     sizes=sizes)
        v = em.emit(value)
        loads.append(f"static __device__ __forceinline__ {d.value_type(r.dtype)} {name}({', '.join(decl)}, "
                     f"int64_t {order.split(', ')[0]}, int64_t {order.split(', ')[1]}) {{\n"
                     + "\n".join(em.lines) + f"\n    return {v};\n}}\n")

    def index_of(bvar, mv, nv):
        return {**unravel_index(mv, m_axes, m_ext), **unravel_index(nv, n_axes, n_ext)}

    n_contiguous = axes[-1] is n_axes[-1] and len(n_axes) == 1
    epilogue, sources, output = contraction_epilogue(lowered, out, decl, index_of, n_contiguous, (1, M, N), sizes)
    return HookedGemm(M, N, K, r.dtype, ", ".join(decl),
                      ", ".join(KernelArgs.args(len(lowered.inputs)) + sizes.names), "".join(loads) + epilogue, sizes,
                      sources, output)


def _prod(values) -> int:
    n = 1
    for v in values:
        n *= v
    return n
