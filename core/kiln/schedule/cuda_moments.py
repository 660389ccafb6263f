"""The column rule's one-pass moments: a sum and the squared deviations around a center of the
same values (a batch norm's mean and variance over N, H and W) read their input once.

A variance is written as two column reductions over one input: a mean M = sum(g) / n, then
V = sum((g - c) * (g - c)) / n', its center c being M at V's element. Each alone is a pass over
the input. Here one first-pass kernel gives every (output, part) of the column split the count,
sum and mean of its values and the sum of their squared deviations from that mean (M2): a
thread by Welford's update over its rows, the block's warps merged by Chan's formula. Then M's
ordinary kernel sums the parts' sums, and V's sums `M2 + count * (mean - c)^2` over the parts:
for any c constant along the reduction, that is exactly the sum of the values' squared
deviations from c, with no difference of large sums in it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kiln.codegen.cuda import CudaDialect
from kiln.codegen.emitter import numel
from kiln.ir.compute import Compute
from kiln.ir.expr import Binary, BinaryOp, Expr, Load, Reduce, Var, walk
from kiln.ir.inline import substitute
from kiln.runtime.cuda import Launch
from kiln.schedule.cuda_kernels import AutoProgram, CudaEmitter, Kernel, at_item, reduce_extent, signature
from kiln.schedule.cuda_split import flat_index, replace_node, replace_reduce


@dataclass
class Moments:
    """A pair of column reductions over the same values g: `total` = sum(g) in buffer `first`,
    and `spread` = sum((g - center) * (g - center)) in the later buffer `second`."""

    first: int
    second: int
    total: Reduce
    spread: Reduce
    center: Expr
    partials: list = field(default_factory=list)    # (count, sum, mean, M2), once the first is written


def squared_deviation(body: Expr) -> tuple[Expr, Expr] | None:
    """(g, c) where `body` is (g - c) * (g - c), else None."""
    if not (isinstance(body, Binary) and body.op == BinaryOp.MUL and body.a.key() == body.b.key()):
        return None
    d = body.a
    if not (isinstance(d, Binary) and d.op == BinaryOp.SUB):
        return None
    return d.a, d.b


def moment_pairs(buffers: list[Compute], plans: list) -> dict[int, Moments]:
    """The pairs of `buffers` (each with its column plan or None) whose second reduces the
    squared deviations of the first's values from a center constant along the reduction (a
    variance around its mean), in float32 or float64, by the index of each buffer of a pair."""
    pairs: dict[int, Moments] = {}
    for second, buf in enumerate(buffers):
        if (not plans[second] or plans[second].reduce.op != "sum" or not plans[second].reduce.dtype.is_float
                or plans[second].reduce.dtype.is_16bit_float):
            continue
        spread = plans[second].reduce
        found = squared_deviation(spread.body)
        if found is None:
            continue
        g, center = found
        axes = {id(a) for a in spread.axes}
        if any(isinstance(x, Var) and id(x) in axes for x in walk(center)):
            continue
        for first in range(second):
            other = buffers[first]
            if first in pairs or not plans[first]:
                continue
            total = plans[first].reduce
            if (total.op != "sum" or total.dtype != spread.dtype or tuple(other.shape) != tuple(buf.shape)
                    or [a.extent for a in total.axes] != [a.extent for a in spread.axes]):
                continue
            renamed = {id(a): b for a, b in zip(spread.axes, total.axes)}
            renamed.update({id(a): b for a, b in zip(buf.axes, other.axes)})
            if substitute(g, renamed).key() == total.body.key():
                pairs[first] = pairs[second] = Moments(first, second, total, spread, center)
                break
    return pairs


def moments_kernel(auto: AutoProgram, args: list, buf: Compute, pair: Moments, parts: int, names: tuple[str, ...],
                   kernel_name: str, lanes: int, rows: int) -> Kernel:
    """The kernel writing, for each element of `buf` (the pair's first buffer) and part of its
    values, their count, sum, mean and M2 into the (outputs, parts) temporaries `names`: a warp's
    `lanes` threads take consecutive outputs, the block's `rows` warps and the grid's `parts`
    split the values."""
    d = CudaDialect()
    items, extent = numel(buf.shape), reduce_extent(pair.total)
    body, emitted = at_item(buf, pair.total.body, auto.names)
    em = CudaEmitter(d, emitted, auto.strides, "thread", indent=1, sizes=auto.sizes)
    vt = d.value_type(pair.total.dtype)
    chunk = -(-extent // parts)
    em.line(f"{vt} t_n = 0, t_s = 0, t_m = 0, t_q = 0;")
    partial = em.open_partial("sum", pair.total.dtype, "t_s", -(-extent // (rows * parts)))
    em.open(f"if (o < {items})")
    em.line("#pragma unroll 4")
    em.open(f"for (int64_t f = (int64_t)blockIdx.y * {chunk} + (threadIdx.x >> 5); "
            f"f < min((int64_t)(blockIdx.y + 1) * {chunk}, (int64_t){extent}); f += {rows})")
    em.unravel(pair.total.axes, [str(a.extent) for a in pair.total.axes], "f")
    em.line(f"const {vt} t_v = {em.emit(body)};")
    em.add_partial(partial, "sum", pair.total.dtype, "t_s", "t_v")
    em.line(f"t_n += 1; const {vt} t_d = t_v - t_m; t_m += t_d / t_n; t_q += t_d * (t_v - t_m);")
    em.close()
    em.close()
    em.close_partial(partial, "t_s")
    count, total, mean, m2 = names
    store = " ".join(f"{out}[o * {parts} + blockIdx.y] = {d.store(pair.total.dtype, value)};"
                     for out, value in ((count, "b_n"), (total, "b_s"), (mean, "b_m"), (m2, "b_q")))
    source = (f'extern "C" __global__ void __launch_bounds__({lanes * rows}) {kernel_name}({signature(d, args)}) {{\n'
              f"    const int64_t o = (int64_t)blockIdx.x * {lanes} + (threadIdx.x & {lanes - 1});\n"
              + "\n".join(em.lines) + "\n"
              f"    __shared__ {vt} t_sh[4][{rows}][{lanes + 1}];\n"
              f"    const int t_w = threadIdx.x >> 5, t_l = threadIdx.x & {lanes - 1};\n"
              "    t_sh[0][t_w][t_l] = t_n; t_sh[1][t_w][t_l] = t_s;\n"
              "    t_sh[2][t_w][t_l] = t_m; t_sh[3][t_w][t_l] = t_q;\n"
              "    __syncthreads();\n"
              f"    if (threadIdx.x < {lanes} && o < {items}) {{\n"
              f"        {vt} b_n = t_sh[0][0][t_l], b_s = t_sh[1][0][t_l];\n"
              f"        {vt} b_m = t_sh[2][0][t_l], b_q = t_sh[3][0][t_l];\n"
              f"        for (int b_w = 1; b_w < {rows}; ++b_w) {{\n"
              f"            const {vt} b_nb = t_sh[0][b_w][t_l], b_all = b_n + b_nb;\n"
              "            if (b_nb == 0) continue;\n"
              f"            const {vt} b_d = t_sh[2][b_w][t_l] - b_m;\n"
              "            b_m += b_d * (b_nb / b_all); b_q += t_sh[3][b_w][t_l] + b_d * b_d * (b_n * b_nb / b_all);\n"
              "            b_s += t_sh[1][b_w][t_l]; b_n = b_all;\n"
              "        }\n"
              f"        {store}\n"
              "    }\n}\n")
    launch = Launch(kernel_name, tuple(n for n, _, _ in args), (lanes * rows, 1, 1),
                    grid=(-(-items // lanes), parts, 1))
    return Kernel(source, launch)


def write_moments(auto: AutoProgram, n: int, buf: Compute, pair: Moments, parts: int, lanes: int, rows: int) -> None:
    """Add the kernels writing `buf`, the task's n-th buffer, one of `pair`'s: for its first,
    the moments kernel into four (outputs, parts) temporaries (count, sum, mean, M2) and then
    the buffer's kernel summing the parts' sums; for its second, the buffer's kernel summing
    `M2 + count * (mean - center)^2` over the parts."""
    out_name = auto.names[id(buf)]
    if n == pair.first:
        t = pair.total.dtype
        temps = [auto.temporary((numel(buf.shape), parts), t) for _ in range(4)]
        args = auto.available + [(x.name, x, False) for x in temps]
        auto.kernels.append(moments_kernel(auto, args, buf, pair, parts, tuple(x.name for x in temps),
                                           f"kiln_k{n}_moments", lanes, rows))
        auto.available = auto.available + [(x.name, x, True) for x in temps]
        pair.partials = temps
        buf = replace_reduce(buf, pair.total, temps[1], parts)
    else:
        count, _, mean, m2 = pair.partials
        flat, part = flat_index(buf), Var("s", parts)
        at = [flat, part]
        deviation = Load(mean, at) - pair.center
        spread = Reduce("sum", [part], Load(m2, at) + Load(count, at) * deviation * deviation, pair.spread.dtype)
        buf = Compute(buf.name, buf.axes, replace_node(buf.value, pair.spread, spread))
    auto.write(n, buf, out_name)
