"""The C hooks of the CPU GEMM templates, rendered from a task's compute definition.

A task whose single output is `epilogue(sum_k fa * fb)` (matmul, batched matmul, linear,
convolution; bias, activation, residual and casts fused around the sum) is seen as a batch of
GEMMs `C[b, m, n] = sum_k A[b, m, k] * B[b, k, n]`:

- n enumerates the output's innermost axes that only the factor `fb` uses (so consecutive n
  are consecutive output elements), m the axes only `fa` uses, b every other output axis;
  k enumerates the reduction axes;
- `kiln_a(PARAMS, b, m, k)` returns A's value in float and `kiln_b_row(PARAMS, b, k, n0, count,
  dst)` writes B's values for n0 .. n0 + count - 1 to `dst` (loads with any strides, 16-bit
  conversions, convolution padding), for the template's packing. The row runs along the
  innermost output axis without index division, so the C compiler vectorizes it;
  `kiln_b_col(PARAMS, b, n, k0, count, dst, stride)` writes B's values for k0 .. k0 + count - 1
  to dst[0], dst[stride], ..., for a B read along k (the weight of `linear`);
- `kiln_epilogue_row(PARAMS, b, m, n0, count, acc)` computes and stores output elements
  (b, m, n0 .. n0 + count - 1) from the float accumulators `acc[0 .. count - 1]`.

The template owns tiling, packing and threads; these hooks own every index and dtype. The
hooks' parameters are the macro `PARAMS` (the kernel's; `ARGS` passes them on), which the
template defines before them: the task's buffers (`CpuGemm.buffers`), what the template adds,
then the symbolic sizes (`kiln.codegen.sizes`), which `batch`, M, N and K are written in
(`CpuGemm.text`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from kiln.template import (CDialect, Check, Compute, Const, Emitter, Expr, KernelArgs, Load, Reduce, SizeArgs, SizeVar,
                           SymSize, Task, Unary, Var, cast, dtypes, gemm_factors, inline_task, row_major_strides, simplify,
                           strip_cast, substitute, top_reduces, unravel_index, variables_of, walk)

FACTOR_DTYPES = (dtypes.float32, dtypes.float16, dtypes.bfloat16)

# Unary operations whose C is a call of libm (`kiln.codegen`'s KILN_SIMD_FN functions), which GCC
# vectorizes (glibc's vector variants) only in a loop it vectorizes, never in straight-line code
LIBM_UNARY = frozenset({"exp", "exp_approx", "expm1", "log", "log1p", "log2", "sin", "cos", "tan", "tanh", "asin",
                        "acos", "atan", "sinh", "cosh", "asinh", "acosh", "atanh", "erf"})


def calls_libm(task: Task) -> bool:
    """Whether `task`'s outputs call libm per element (LIBM_UNARY: GELU's erf or tanh, SiLU's
    exp): the CPU templates' `KILN_ROW_BY_ROW` (`cpu/common.h`) then lets GCC vectorize the loop
    over a tile's rows, where the vector variants' lanes are rows."""
    return any(_calls_libm(out.value) for out in inline_task(task).outputs)


def _calls_libm(value: Expr) -> bool:
    return any(isinstance(e, Unary) and e.op in LIBM_UNARY for e in walk(value))


@dataclass
class CpuGemm:
    """A task seen as `batch` GEMMs of M x N x K through the C hooks in `hooks`."""

    batch: int
    M: int
    N: int
    K: int
    hooks: str           # C source of kiln_a, kiln_b_row, kiln_b_col and kiln_epilogue_row
    b_by_k: bool         # B is contiguous along k in memory: kiln_b_col packs it faster
    buffers: list[str]   # the kernel's buffer parameters: inputs in order, then out0
    sizes: SizeArgs      # its symbolic sizes
    b_input: int | None  # the one input B reads, the same for every batch, with N and K fixed
                         # (what a preparation may lay out once where it is a constant), or None

    def text(self, size) -> str:
        """C text of a size of the task (see `kiln.codegen.sizes.SizeArgs.text`)."""
        return self.sizes.text(size)


def _constant_b(fb: Expr, inputs, b_axes) -> int | None:
    """The index of the one input that B's factor `fb` reads, where the factor is the same for
    every batch and at every size (fixed shapes, no size in its index arithmetic), else None."""
    reads = list({id(x.tensor): x.tensor for x in walk(fb) if isinstance(x, Load)}.values())
    if (len(reads) != 1 or any(isinstance(s, SymSize) for s in reads[0].shape)
            or any(isinstance(x, SizeVar) for x in walk(fb)) or variables_of(fb) & {id(a) for a in b_axes}):
        return None
    return next((k for k, t in enumerate(inputs) if t is reads[0]), None)


def _reads(e: Expr, dtype_ok) -> bool:
    return all(dtype_ok(x.dtype) for x in walk(e) if isinstance(x, Load))


def _b_row(fb, sizes, names, strides, var_names, b_index, k_index, n_axes, n_ext) -> str:
    """`kiln_b_row`: B's values along n, in runs over the innermost n axis (the outer n axes'
    indices are unravelled once per run), or in one run where B's index arithmetic over the
    flat n has no division left (a 1x1 convolution reads its pixels contiguously)."""
    d = CDialect()
    flat = Var("i", math.prod(n_ext))
    value = simplify(cast(substitute(fb, {**b_index, **k_index, **unravel_index(flat, n_axes, n_ext)}), dtypes.float32))
    outer = Var("o", 1)
    if any(getattr(x, "op", None) in ("floordiv", "mod") and id(flat) in variables_of(x) for x in walk(value)):
        outer, inner = Var("o", max(math.prod(n_ext[:-1]), 1)), Var("i", n_ext[-1])
        index = {**b_index, **k_index, **unravel_index(outer, n_axes[:-1], n_ext[:-1]), id(n_axes[-1]): inner}
        value = simplify(cast(substitute(fb, index), dtypes.float32))
    else:
        inner = flat
    em = Emitter(d, {**names, **var_names, id(outer): "o", id(inner): "i"}, strides, indent=3, sizes=sizes)
    v = em.emit(value)
    extent = em.size(inner.extent)
    return (f"static inline void kiln_b_row(PARAMS, int64_t b, int64_t k, int64_t n0, int64_t count, "
            f"float* __restrict__ dst) {{\n"
            f"    for (int64_t n = n0, end = n0 + count; n < end;) {{\n"
            f"        const int64_t o = n / {extent}, i0 = n % {extent};\n"
            f"        const int64_t i1 = i0 + (end - n) < {extent} ? i0 + (end - n) : {extent};\n"
            f"        float* __restrict__ row = dst + (n - n0) - i0;\n"
            f"        for (int64_t i = i0; i < i1; ++i) {{\n" + "\n".join(em.lines) + "\n"
            f"            row[i] = {v};\n        }}\n        n += i1 - i0;\n    }}\n}}\n")


def reports_failures(e: Expr) -> bool:
    """Whether `e` checks anything (a gather's index bound): the C hooks have no status buffer
    to report a failed check through, so the CPU templates decline tasks whose output checks
    (the auto-scheduler's kernels report them)."""
    return any(isinstance(x, Check) for x in walk(e))


@dataclass
class GemmForm:
    """How a task is a batch of GEMMs, before any C is written: the lowered task, its output and
    the output's one reduction `r`, the factors `fa` and `fb` of its product, the output axes
    grouped as b, m and n with their extents, the reduction's extents, and the GEMMs' sizes."""

    lowered: object                         # `inline_task`'s Lowered
    out: Compute
    r: Reduce
    fa: Expr
    fb: Expr
    axes: tuple[list, list, list]           # the b, m and n axes
    extents: tuple[list, list, list, list]  # the b, m, n and k extents
    batch: int
    M: int
    N: int
    K: int


def gemm_form(task: Task) -> GemmForm | None:
    """`task` as batched GEMMs (see `match_cpu_gemm`, which declines exactly the tasks this
    does), without rendering the hooks: what a template's `applies` needs, found once per task.
    Fusion asks it of every candidate group, most of which never render."""
    return task.derived(_gemm_form)


def _gemm_form(task: Task) -> GemmForm | None:
    lowered = inline_task(task)
    if len(lowered.buffers) != 1 or len(lowered.outputs) != 1:
        return None
    out = lowered.outputs[0]
    if not out.shape or not all(isinstance(s, int) for s in out.shape) or reports_failures(out.value):
        return None
    reduces = top_reduces(out.value)
    if len(reduces) != 1 or reduces[0].op != "sum" or reduces[0].dtype != dtypes.float32:
        return None
    r = reduces[0]
    if any(not isinstance(a.extent, int) for a in r.axes) or any(
            isinstance(x, Reduce) for x in walk(r.body) if x is not r):
        return None
    axes = list(out.axes)
    factors = gemm_factors(strip_cast(r.body), {id(a) for a in axes})
    if factors is None or not _reads(r.body, lambda t: t in FACTOR_DTYPES):
        return None
    fa, fb = factors
    last = id(axes[-1])
    if last in variables_of(fa) and last not in variables_of(fb):
        fa, fb = fb, fa
    uses_a, uses_b = variables_of(fa), variables_of(fb)
    if last not in uses_b or last in uses_a:
        return None
    n_count = 0
    while n_count < len(axes) and id(axes[-1 - n_count]) in uses_b - uses_a:
        n_count += 1
    n_axes = axes[len(axes) - n_count:]
    m_axes = [a for a in axes[:len(axes) - n_count] if id(a) in uses_a - uses_b]
    b_axes = [a for a in axes[:len(axes) - n_count] if id(a) not in uses_a - uses_b]
    extent = dict(zip(map(id, axes), out.shape))
    b_ext, m_ext, n_ext = ([extent[id(a)] for a in group] for group in (b_axes, m_axes, n_axes))
    k_ext = [a.extent for a in r.axes]
    return GemmForm(lowered, out, r, fa, fb, (b_axes, m_axes, n_axes), (b_ext, m_ext, n_ext, k_ext),
                    math.prod(b_ext), math.prod(m_ext), math.prod(n_ext), math.prod(k_ext))


def match_cpu_gemm(task: Task) -> CpuGemm | None:
    """`task` as batched GEMMs with C hooks, or None when it is not one float32-accumulated
    sum of a product of float32/float16/bfloat16 factors (then the auto-scheduler takes it).
    Found once per task (`Task.derived`: the compile of a task and its renderings all ask): the
    CpuGemm is shared, so a renderer adds sizes to a copy of its `sizes`."""
    return task.derived(_match_cpu_gemm)


def _match_cpu_gemm(task: Task) -> CpuGemm | None:
    form = gemm_form(task)
    if form is None:
        return None
    lowered, out, r, fa, fb = form.lowered, form.out, form.r, form.fa, form.fb
    b_axes, m_axes, n_axes = form.axes
    b_ext, m_ext, n_ext, k_ext = form.extents
    B, M, N, K = form.batch, form.M, form.N, form.K
    d = CDialect()
    sizes = SizeArgs()
    names = KernelArgs.names(lowered.inputs)
    strides = {id(t): row_major_strides(t.shape) for t in lowered.inputs}
    bv, mv, nv, kv = Var("b", max(B, 1)), Var("m", M), Var("n", N), Var("k", K)
    b_index = unravel_index(bv, b_axes, b_ext)
    m_index, n_index = unravel_index(mv, m_axes, m_ext), unravel_index(nv, n_axes, n_ext)
    k_index = unravel_index(kv, r.axes, k_ext)
    var_names = {id(bv): "b", id(mv): "m", id(nv): "n", id(kv): "k"}

    value = simplify(cast(substitute(fa, {**b_index, **m_index, **k_index}), dtypes.float32))
    em = Emitter(d, {**names, **var_names}, strides, sizes=sizes)
    v = em.emit(value)
    hooks = [f"static inline float kiln_a(PARAMS, int64_t b, int64_t m, int64_t k) {{\n"
             + "\n".join(em.lines) + f"\n    return {v};\n}}\n", _b_row(fb, sizes, names, strides, var_names,
                                                                     b_index, k_index, n_axes, n_ext)]
    value = simplify(cast(substitute(fb, {**b_index, **n_index, **k_index}), dtypes.float32))
    em = Emitter(d, {**names, **var_names}, strides, indent=2, sizes=sizes)
    v = em.emit(value)
    hooks.append(f"static inline void kiln_b_col(PARAMS, int64_t b, int64_t n, int64_t k0, int64_t count, "
                 f"float* __restrict__ dst, int64_t stride) {{\n"
                 f"    for (int64_t k = k0; k < k0 + count; ++k) {{\n" + "\n".join(em.lines)
                 + f"\n        dst[(k - k0) * stride] = {v};\n    }}\n}}\n")
    load = strip_cast(fb)
    b_by_k = (isinstance(load, Load) and len(r.axes) == 1 and load.indices[-1] is r.axes[0]
              and load.tensor.shape[-1] > 1)
    b_input = _constant_b(fb, lowered.inputs, b_axes)

    hooks.append(render_epilogue_row(lowered, out, {**b_index, **m_index, **n_index}, var_names, "PARAMS", sizes))
    return CpuGemm(B, M, N, K, "".join(hooks), b_by_k, KernelArgs.params(d, lowered.inputs, [out]), sizes, b_input)


def render_epilogue_row(lowered, out, index: dict, var_names: dict, params: str, sizes: SizeArgs | None = None) -> str:
    """`kiln_epilogue_row(params, b, m, n0, count, acc)`: computes and stores the output elements
    whose axes (by id) `index` gives as expressions of index variables that `var_names` names
    b, m and n, for n = n0 .. n0 + count - 1, from the float accumulators acc[n - n0] (each
    taking the place of the output value's one top-level reduction); symbolic sizes written
    through `sizes` where given."""
    d = CDialect()
    names = {**KernelArgs.names(lowered.inputs), **var_names}
    strides = {id(t): row_major_strides(t.shape) for t in lowered.inputs}
    value = simplify(substitute(out.value, index))
    out_strides = row_major_strides(out.shape)
    flat = simplify(sum((index[id(a)] * s for a, s in zip(out.axes, out_strides)), Const(0, dtypes.int64)))
    em = Emitter(d, names, strides, indent=2, sizes=sizes)
    em.scopes[0][top_reduces(value)[0].key()] = "acc[n - n0]"
    stored = d.store(out.dtype, em.emit(value))
    em.line(f"{KernelArgs.output(0)}[{em.emit(flat)}] = {stored};")
    # a loop calling libm is vectorized over n, a lane a column, with glibc's vector variants
    # (else GCC unrolls a constant count and calls the scalar function column by column)
    simd = "    #pragma omp simd\n" if _calls_libm(value) else ""
    return (f"static inline void kiln_epilogue_row({params}, int64_t b, int64_t m, int64_t n0, "
            f"int64_t count, const float* __restrict__ acc) {{\n"
            f"{simd}    for (int64_t n = n0; n < n0 + count; ++n) {{\n" + "\n".join(em.lines) + "\n    }\n}\n")
