"""Fusion hooks of templates: the parts of a template's kernel the core renders from the IR.

A contraction template (matmul, batched matmul, linear, convolution as implicit GEMM) computes
`acc[b, m, n] = sum_k A[b, m, k] * B[b, k, n]` with its own tiling, and never spells how an
output element is made from `acc`, nor where it goes: it calls the epilogue hook

    kiln_epilogue(KILN_PARAMS, b, m, n, acc)

which the core renders from the output's compute definition (the element's value with its
reduction replaced by `acc`: a bias, an activation, a cast, whatever fusion put there) and
which stores the element; `kiln_epilogue2(KILN_PARAMS, b, m, n, acc0, acc1)` does the same
for the neighbours n and n + 1, with one packed store where alignment allows. Operands are described by `Operand` (buffer and strides), which
a template reads with its own vectorized copies when they are plain loads.
"""
from __future__ import annotations

from dataclasses import dataclass

from kiln.codegen.cuda import CudaDialect, top_reduces
from kiln.codegen.emitter import Emitter, row_major_strides
from kiln.dtypes import DataType
from kiln.ir.compute import Task
from kiln.ir.expr import Cast, Const, Expr, Load, Var
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

    @property
    def k_contiguous(self) -> bool:
        return self.k_stride == 1

    @property
    def x_contiguous(self) -> bool:
        return self.x_stride == 1


@dataclass
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
    params: str             # the kernel's parameter list
    args: str               # the same names, to pass them on
    epilogue: str           # source of the kiln_epilogue and kiln_epilogue2 device functions

    @property
    def batch_count(self) -> int:
        n = 1
        for s in self.batch:
            n *= s
        return n

    def batch_offset(self, operand: Operand, flat: str) -> str:
        """C expression of `operand`'s offset for the flat batch index `flat`."""
        terms, inner = [], 1
        for size, stride in reversed(list(zip(self.batch, operand.batch_strides))):
            if stride and size > 1:
                terms.append(f"(({flat}) / {inner} % {size}) * (int64_t){stride}")
            inner *= size
        return " + ".join(terms) or "0"


def _strip_cast(e: Expr) -> Expr:
    return e.a if isinstance(e, Cast) else e


def _operand(load: Load, roles: dict[int, str], nbatch: int, x_role: str, params: dict) -> Operand | None:
    strides = row_major_strides(load.tensor.shape)
    coef = {}
    for index, stride in zip(load.indices, strides):
        if isinstance(index, Const) and index.value == 0:
            continue
        if not isinstance(index, Var) or id(index) not in roles or roles[id(index)] in coef:
            return None
        coef[roles[id(index)]] = stride
    if set(coef) - {x_role, "k"} - {f"b{d}" for d in range(nbatch)} or "k" not in coef or x_role not in coef:
        return None
    if id(load.tensor) not in params:
        return None
    return Operand(params[id(load.tensor)], load.tensor.dtype,
                   tuple(coef.get(f"b{d}", 0) for d in range(nbatch)), coef[x_role], coef["k"])


def match_contraction(task: Task) -> Contraction | None:
    """The contraction `task` computes, or None when it is not one (or its operands are not
    plain loads of its inputs)."""
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
    body = _strip_cast(r.body)
    if getattr(body, "op", None) != "mul":
        return None
    x, y = _strip_cast(body.a), _strip_cast(body.b)
    if not (isinstance(x, Load) and isinstance(y, Load)) or x.dtype != y.dtype:
        return None
    axes = out.axes
    nbatch = len(axes) - 2
    roles = {id(a): f"b{d}" for d, a in enumerate(axes[:nbatch])}
    roles.update({id(axes[-2]): "m", id(axes[-1]): "n", id(r.axes[0]): "k"})
    d = CudaDialect()
    params = {id(t): f"in{k}" for k, t in enumerate(lowered.inputs)}
    a = _operand(x, roles, nbatch, "m", params)
    b = _operand(y, roles, nbatch, "n", params)
    if a is None or b is None:
        a, b = _operand(y, roles, nbatch, "m", params), _operand(x, roles, nbatch, "n", params)
    if a is None or b is None or not isinstance(r.axes[0].extent, int):
        return None
    decl = [f"const {d.storage_type(t.dtype)}* __restrict__ in{k}" for k, t in enumerate(lowered.inputs)]
    decl.append(f"{d.storage_type(out.dtype)}* __restrict__ out0")
    names = [f"in{k}" for k in range(len(lowered.inputs))] + ["out0"]
    return Contraction(out.shape[:-2], out.shape[-2], out.shape[-1], r.axes[0].extent, a, b, r.dtype,
                       out.dtype, ", ".join(decl), ", ".join(names), _epilogue(lowered, out, decl))


def _epilogue(lowered, out, decl: list[str]) -> str:
    """Two device functions computing and storing output elements from accumulators:
    `kiln_epilogue(params, b, m, n, acc)` for out[b..., m, n], and
    `kiln_epilogue2(params, b, m, n, acc0, acc1)` for out[b..., m, n] and out[b..., m, n + 1]
    (n + 1 < N; one packed store where N is even and n is)."""
    d = CudaDialect()
    M, N = out.shape[-2], out.shape[-1]
    bvar, mvar = Var("b", 1 << 62), Var("m", M)
    nvars = [Var("n", N), Var("n1", N)]
    index, inner = {}, 1
    for axis, size in reversed(list(zip(out.axes[:-2], out.shape[:-2]))):
        index[id(axis)] = simplify((bvar // inner) % size)
        inner *= size
    index[id(out.axes[-2])] = mvar
    names = {id(t): f"in{k}" for k, t in enumerate(lowered.inputs)}
    names.update({id(bvar): "b", id(mvar): "m", id(nvars[0]): "n", id(nvars[1]): "n1"})
    strides = {id(t): row_major_strides(t.shape) for t in lowered.inputs}
    head = f"static __device__ __forceinline__ void"
    params = f"{', '.join(decl)}, int64_t b, int64_t m, int64_t n"
    flat = f"(b * {M} + m) * {N} + n"
    functions = []
    for count in (1, 2):
        em = Emitter(d, names, strides)
        values = []
        for k in range(count):
            value = simplify(substitute(out.value, {**index, id(out.axes[-1]): nvars[k]}))
            em.scopes[0][top_reduces(value)[0].key()] = f"acc{k}" if count == 2 else "acc"
            values.append(d.store(out.dtype, em.emit(value)))
        acc_type = d.value_type(top_reduces(out.value)[0].dtype)
        if count == 1:
            em.line(f"out0[{flat}] = {values[0]};")
            functions.append(f"{head} kiln_epilogue({params}, {acc_type} acc) {{\n" + "\n".join(em.lines) + "\n}\n")
            continue
        size = out.dtype.nbytes
        if N % 2 == 0 and size in (2, 4):
            word = "uint32_t" if size == 2 else "uint64_t"
            as_bits = (lambda v: f"(uint32_t)(uint16_t)({v})") if size == 2 else (lambda v: f"(uint64_t)__float_as_uint({v})") \
                if out.dtype.is_float else (lambda v: f"(uint64_t)(uint32_t)({v})")
            em.line(f"*({word}*)&out0[{flat}] = {as_bits(values[0])} | ({as_bits(values[1])} << {size * 8});")
        else:
            em.line(f"out0[{flat}] = {values[0]};")
            em.line(f"out0[{flat} + 1] = {values[1]};")
        functions.append(f"{head} kiln_epilogue2({params}, {acc_type} acc0, {acc_type} acc1) {{\n"
                         f"    const int64_t n1 = n + 1;\n" + "\n".join(em.lines) + "\n}\n")
    return "".join(functions)
