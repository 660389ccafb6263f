"""Row tasks: tasks whose other buffers are per-row statistics of their one row output.

Softmax's max and sum, layer_norm's mean and variance, RMSNorm's mean of squares (with the
injective producers and consumers fused around them): after inlining (`kiln.ir.inline`) each
reduction is a buffer indexed by the output's leading axes (the *row*), read by the output
and by later statistics only at their own row. Such a task runs as one kernel per target that
computes a row's statistics once, into locals (registers), and then writes the row; the CPU
rule (`kiln.schedule.cpu_rows`) and the CUDA rule (`kiln.schedule.cuda_rows`) share what is
here: recognising the task (`row_task`) and its row form (`row_form`), in which every value
is an expression of the row `o` and the element `e` of the row, and each statistic a scalar.
A statistic may be an output of the task too (layer_norm's mean and rstd, which training saves
for the backward): the kernel writes it from the row's reduction results, one value a row. A
sum over the row of a one-hot row (nll_loss's gradient, summed by log-softmax's backward) takes
its closed form in the row form: no loop over the row.
An element-wise task (`elementwise_prefix`) is a row task with no statistics: the same kernels
write it a pack of elements at a time, its index arithmetic once a row.
"""
from __future__ import annotations

from dataclasses import dataclass

from kiln import dtypes
from kiln.codegen.emitter import numel
from kiln.codegen.hooks import unravel_index
from kiln.ir.compute import Compute, TensorInput
from kiln.ir.expr import Binary, Const, Expr, Load, Reduce, Select, Unary, Var, top_reduces, walk
from kiln.ir.inline import Lowered, own_children, rebuild_expr, substitute
from kiln.ir.size import SymSize, distinct
from kiln.ir.simplify import simplify


def _top_reduces(e: Expr) -> bool:
    """Whether `e` holds a reduction of its own (not through a load)."""
    return any(isinstance(x, Reduce) for x in walk(e))


def _statistic_prefix(shape: tuple[int, ...]) -> int:
    """The length of `shape` without its trailing 1s (a keepdim statistic's own axes)."""
    n = len(shape)
    while n and shape[n - 1] == 1:
        n -= 1
    return n


def _unit_index(i: Expr) -> bool:
    """Whether index `i` is always 0 (a constant 0 or an axis of extent 1)."""
    return (isinstance(i, Const) and i.value == 0) or (isinstance(i, Var) and i.extent == 1)


def _flat(indices, shape) -> Expr:
    """The simplified row-major flat index of `indices` in `shape` (an index that is always 0,
    an axis of extent 1 among them, counts as 0: a batch of one reads its rows at a constant)."""
    flat = Const(0, dtypes.int64)
    for i, size in zip(indices, shape):
        flat = flat * size + (Const(0, dtypes.int64) if _unit_index(i) else i)
    return simplify(flat)


def _row_axes(shape: tuple[int, ...], rows: int) -> int | None:
    """The largest p < len(shape) whose leading axes `shape[:p]` hold `rows` elements, or None."""
    found, n = None, 1
    for p, size in enumerate(shape):
        if n == rows:
            found = p
        n *= size
    return found


def row_task(lowered: Lowered, min_rows: int = 1, short_row: int = 0) -> tuple[Compute, int] | None:
    """The row output of `lowered` and the number p of its leading axes that make `lowered` a
    row task, or None.

    A row task writes one *row output* and computes *statistics*: every other buffer of the
    task, its temporaries and its further outputs (a layer norm's mean and rstd, saved for the
    backward), some of them reductions. Every statistic must hold one value per row (its shape
    without trailing 1s, a statistic kept with its reduced dims, has as many elements as the
    row output's first p axes) and be read only at its reader's own row: the flat index of the
    read's leading indices is the flat index of the reader's row (the output may be a reshape
    of the rows the statistics were computed over: layer_norm(x).view(-1, d)), or, for the
    output of a task that writes no statistic, a permutation of its row axes (`permuted_rows`:
    layer_norm(x).transpose(0, 1)). The row output must have further axes (the row), hold no
    reduction itself, be read by no statistic (they are computed before it), and have
    `min_rows` rows at least, unless their number is symbolic (one kernel then serves every
    size: the row kernel) or each row has at most `short_row` elements (and some). The row
    output is the first output, of the most elements first, that makes the task a row task
    (rows of one element leave the choice open)."""
    for out in sorted(lowered.outputs, key=lambda t: -numel(t.shape)):
        p = _row_prefix(lowered, out, min_rows, short_row)
        if p is not None:
            return out, p
    return None


def statistics(lowered: Lowered, out: Compute) -> list[Compute]:
    """The statistics of the row task `lowered` of row output `out`: its other buffers, in order."""
    return [b for b in lowered.buffers if b is not out]


def _row_prefix(lowered: Lowered, out: Compute, min_rows: int, short_row: int) -> int | None:
    """The prefix p that makes `lowered` a row task of row output `out` (see `row_task`), or None."""
    stats = statistics(lowered, out)
    if not any(_top_reduces(t.value) for t in stats) or _top_reduces(out.value):
        return None
    counts = distinct(numel(t.shape[:_statistic_prefix(t.shape)]) for t in stats)
    if len(counts) != 1:
        return None
    rows, = counts
    p = _row_axes(out.shape, rows)
    if p is None or p == 0 or p >= len(out.shape):
        return None
    if rows < min_rows and not isinstance(rows, SymSize) and not 0 < numel(out.shape[p:]) <= short_row:
        return None
    stat_ids = {id(t): _statistic_prefix(t.shape) for t in stats}
    permuted = permuted_rows(lowered, out, p)
    for buf in lowered.buffers:
        if buf is out and permuted:
            continue
        own = p if buf is out else stat_ids[id(buf)]
        row = _flat(buf.axes[:own], buf.shape[:own]).key()
        for e in walk(buf.value):
            if isinstance(e, Load) and e.tensor is out:
                return None
            if isinstance(e, Load) and id(e.tensor) in stat_ids:
                lead = stat_ids[id(e.tensor)]
                if _flat(e.indices[:lead], e.tensor.shape[:lead]).key() != row:
                    return None
                if not all(_unit_index(i) for i in e.indices[lead:]):
                    return None
    return p


def permuted_rows(lowered: Lowered, out: Compute, p: int) -> list[Expr] | None:
    """Where `out` is the task's only output, every statistic has the same shape, and `out`
    (rows of its first `p` axes) reads them all at the same leading indices, each an axis of
    the output's row (all different) or always 0, and not at the output's own flat row: those
    indices, a permutation of the rows; else None."""
    stats = statistics(lowered, out)
    temps = {id(t): _statistic_prefix(t.shape) for t in stats}
    shapes = distinct(tuple(t.shape[:temps[id(t)]]) for t in stats)
    reads = {tuple(i.key() for i in e.indices[:temps[id(e.tensor)]]): e.indices[:temps[id(e.tensor)]]
             for e in walk(out.value) if isinstance(e, Load) and id(e.tensor) in temps}
    if len(lowered.outputs) != 1 or len(shapes) != 1 or len(reads) != 1:
        return None
    (shape,), (lead,) = shapes, reads.values()
    axes = {id(a) for a in out.axes[:p]}
    used = [id(i) for i in lead if not _unit_index(i)]
    if (any(not _unit_index(i) and not (isinstance(i, Var) and id(i) in axes) for i in lead)
            or len(set(used)) != len(used) or len(used) != sum(a.extent != 1 for a in out.axes[:p])
            or _flat(lead, shape).key() == _flat(out.axes[:p], out.shape[:p]).key()):
        return None
    return list(lead)


def elementwise_prefix(lowered: Lowered, min_rows: int, min_row_len: int) -> int | None:
    """For a task of one injective output and nothing else (no temporary, no reduction), the
    number p of leading axes that leave it at least `min_rows` rows of at least `min_row_len`
    elements (as few trailing axes in the row as that takes, so that the row's element is one
    axis where it can be); None for any other task, where no such split exists, or where a
    size is symbolic (the split would then differ from size to size: one general kernel serves
    them all)."""
    shape = lowered.outputs[0].shape
    if (lowered.temporaries or len(lowered.outputs) != 1 or _top_reduces(lowered.outputs[0].value)
            or any(isinstance(size, SymSize) for size in shape)):
        return None
    for p in range(len(shape) - 1, 0, -1):
        if numel(shape[p:]) >= min_row_len:
            return p if numel(shape[:p]) >= min_rows else None
    return None


@dataclass
class RowForm:
    """A row task in row form: `rows` rows of `row_len` elements; `o` the row, `e` the element
    of the row; `stats[k]` the value of the k-th statistic (`statistics[k]`) of row `o`, which
    later values read as a load of `scalars[k]` (a scalar tensor, no indices), and which, where
    `written[k]`, is an output of the task, written at its element `o`; `result` the element
    `e` of row `o` of the row output."""

    rows: int
    row_len: int
    o: Var
    e: Var
    statistics: list[Compute]
    scalars: list[TensorInput]
    stats: list[Expr]
    written: list[bool]
    result: Expr


def row_form(lowered: Lowered, out: Compute, p: int) -> RowForm:
    """The row form of `lowered`, a row task of row output `out` and prefix `p` (see
    `row_task`). Reductions over exactly the row's elements become reductions over `e` (their
    axes unflattened from it)."""
    rows, row_len = numel(out.shape[:p]), numel(out.shape[p:])
    o, e = Var("o", rows), Var("e", row_len)
    stats = statistics(lowered, out)
    scalars = {id(t): TensorInput(f"{t.name}_row", (), t.dtype) for t in stats}
    out_rows = unravel_index(o, out.axes[:p], out.shape[:p])
    permuted = permuted_rows(lowered, out, p)

    def row_index(buf) -> dict:
        own = p if buf is out else _statistic_prefix(buf.shape)
        if buf is out:
            index = {**out_rows, **unravel_index(e, buf.axes[p:], out.shape[p:])}
        elif permuted:      # the statistics of the row the output's row o reads
            index = {id(a): simplify(substitute(i, out_rows)) for a, i in zip(buf.axes[:own], permuted)}
        else:
            index = unravel_index(o, buf.axes[:own], buf.shape[:own])
        if buf is not out:
            index.update({id(a): Const(0, dtypes.int64) for a in buf.axes[own:]})
        return index

    def value_of(buf) -> Expr:
        value = substitute(buf.value, row_index(buf))
        return simplify(_one_hot_sums(_scalar_loads(_row_reduces(value, e, row_len), scalars), e, row_len))

    outputs = {id(t) for t in lowered.outputs}
    return RowForm(rows, row_len, o, e, stats, [scalars[id(t)] for t in stats],
                   [value_of(t) for t in stats], [id(t) in outputs for t in stats], value_of(out))


def _row_reduces(value: Expr, e: Var, row_len: int) -> Expr:
    """`value` with each top reduction over exactly the row's elements rewritten as a
    reduction over `e` (its axes unflattened from `e`, row-major)."""
    memo = {}

    def over_row(r: Reduce) -> Expr:
        extents = [a.extent for a in r.axes]
        if any(not isinstance(x, int) for x in extents) or numel(extents) != row_len:
            return r
        index, inner = {}, 1
        for axis, size in reversed(list(zip(r.axes, extents))):
            index[id(axis)] = e if size == row_len else (e // inner) % size if inner > 1 else e % size
            inner *= size
        return Reduce(r.op, [e], substitute(r.body, index), r.dtype)

    def visit(x):
        if id(x) not in memo:
            if isinstance(x, Reduce):
                memo[id(x)] = over_row(x)
            elif isinstance(x, (Var, Load)) or not x.children():
                memo[id(x)] = x
            else:
                memo[id(x)] = rebuild_expr(x, [visit(k) for k in own_children(x)])
        return memo[id(x)]

    return visit(value)


def _one_hot_sums(value: Expr, e: Var, row_len: int) -> Expr:
    """`value` with each sum over the row of select((e == k) and r, a, b), with k, r, a and b
    the same for every element of the row (a one-hot row, as the backward of a gather or of
    nll_loss writes), in closed form: a + (n - 1) * b where r holds and 0 <= k < n, n * b
    elsewhere (n the row's length) -- no loop over the row."""
    memo = {}

    def closed(r: Reduce) -> Expr:
        body = r.body
        if not (r.op == "sum" and r.axes == (e,) and isinstance(body, Select) and body.dtype == r.dtype
                and body.dtype.is_float and _free_of(body.a, e) and _free_of(body.b, e)):
            return r
        terms = _conjuncts(body.cond)
        hits = [t for t in terms if isinstance(t, Binary) and t.op == "eq" and _one_side_is(t, e)]
        if len(hits) != 1 or not all(_free_of(t, e) for t in terms if t is not hits[0]):
            return r
        k = hits[0].b if hits[0].a is e else hits[0].a
        if not k.dtype.is_integer:
            return r
        n = Const(int(row_len), k.dtype)
        hit = Binary("and", Binary("ge", k, Const(0, k.dtype), dtypes.boolean),
                     Binary("lt", k, n, dtypes.boolean), dtypes.boolean)
        for t in terms:
            if t is not hits[0]:
                hit = Binary("and", hit, t, dtypes.boolean)
        t = body.dtype
        return Select(hit, Binary("add", body.a, Binary("mul", body.b, Const(float(row_len - 1), t), t), t),
                      Binary("mul", body.b, Const(float(row_len), t), t))

    def visit(x):
        if id(x) not in memo:
            if isinstance(x, Reduce):
                memo[id(x)] = closed(x)
            elif isinstance(x, (Var, Load)) or not x.children():
                memo[id(x)] = x
            else:
                memo[id(x)] = rebuild_expr(x, [visit(k) for k in own_children(x)])
        return memo[id(x)]

    return value if isinstance(row_len, SymSize) else visit(value)


def _free_of(x: Expr, e: Var) -> bool:
    """Whether `x` is the same for every element `e` of the row (it may read memory)."""
    return not any(y is e or isinstance(y, Reduce) for y in walk(x))


def _conjuncts(cond: Expr) -> list[Expr]:
    """The terms of a tree of logical ands."""
    if isinstance(cond, Binary) and cond.op == "and":
        return _conjuncts(cond.a) + _conjuncts(cond.b)
    return [cond]


def _one_side_is(t: Binary, e: Var) -> bool:
    """Whether one operand of `t` is `e` and the other the same for every element."""
    return (t.a is e and _free_of(t.b, e)) or (t.b is e and _free_of(t.a, e))


def _scalar_loads(value: Expr, scalars: dict) -> Expr:
    """Loads of a temporary (now of its row scalar) with their indices dropped."""
    memo = {}

    def visit(x):
        if id(x) not in memo:
            if isinstance(x, Load):
                found = scalars.get(id(x.tensor))
                memo[id(x)] = Load(found, ()) if found is not None else Load(x.tensor, [visit(i) for i in x.indices])
            else:
                memo[id(x)] = x if isinstance(x, Var) or not x.children() else \
                    rebuild_expr(x, [visit(k) for k in own_children(x)])
        return memo[id(x)]

    return visit(value)


def row_uniform(x: Expr, e: Var) -> bool:
    """Whether `x` is the same for every element of a row and reads only row statistics."""
    return not any(y is e or (isinstance(y, Load) and y.indices) or isinstance(y, Reduce) for y in walk(x))


def row_uniform_parts(value: Expr, e: Var) -> list[Expr]:
    """The largest parts of `value` that are the same for every element of the row and read
    no memory but the row statistics (what a row kernel computes once a row)."""
    found, seen = [], set()

    def visit(x):
        if id(x) in seen or isinstance(x, (Const, Var, Load)):
            return
        seen.add(id(x))
        if row_uniform(x, e):
            found.append(x)
        else:
            for k in x.children():
                visit(k)

    visit(value)
    return found


def reciprocals(value: Expr, e: Var) -> Expr:
    """`value` with each floating-point division by a row-uniform divisor (a row statistic)
    made a multiplication by its reciprocal, which a row kernel computes once a row."""
    memo = {}

    def visit(x):
        if id(x) not in memo:
            if isinstance(x, (Var, Load, Const)) or not x.children():
                out = x
            else:
                kids = [visit(k) for k in own_children(x)]
                out = rebuild_expr(x, kids)
                if (isinstance(x, Binary) and x.op == "div" and x.dtype.is_float and not isinstance(x.b, Const)
                        and row_uniform(x.b, e)):
                    out = Binary("mul", kids[0], Binary("div", Const(1.0, x.dtype), kids[1], x.dtype), x.dtype)
            memo[id(x)] = out
        return memo[id(x)]

    return visit(value)


# operations too cheap to keep a value of them in memory or registers rather than recompute it
CHEAP_OPS = ("neg", "abs", "not", "bitnot", "sign", "isnan", "isinf", "add", "sub", "mul", "max", "min",
             "lt", "le", "gt", "ge", "eq", "ne", "and", "or")


def shared_parts(stats: list[Expr], result: Expr, e: Var) -> list[Expr]:
    """The largest costly parts of the output that every row reduction's body computes for
    the same element too (softmax's exp(x - max)): worth keeping instead of recomputing."""
    in_stats, seen = set(), set()

    def collect(x):
        if id(x) in seen:
            return
        seen.add(id(x))
        in_stats.add(x.key())
        if isinstance(x, Select) and (_reads(x.a) or _reads(x.b)):
            collect(x.cond)             # the branches run only for some elements
        elif isinstance(x, Reduce):
            if x.axes == (e,):          # other reductions loop on their own
                collect(x.body)
        elif not isinstance(x, (Var, Load)):
            for k in x.children():
                collect(k)

    for value in stats:
        collect(value)
    found, visited = [], set()

    def visit(x):
        if id(x) in visited or isinstance(x, (Const, Var, Load)):
            return
        visited.add(id(x))
        costly = any(isinstance(y, (Unary, Binary)) and y.op not in CHEAP_OPS for y in walk(x))
        if x.key() in in_stats and costly and any(y is e for y in walk(x)):
            found.append(x)
            return
        for k in x.children():
            visit(k)

    visit(result)
    return found


def _reads(x: Expr) -> bool:
    """Whether `x` reads memory (a load or a reduction)."""
    return any(isinstance(y, (Load, Reduce)) for y in walk(x))


def run_of_reductions(form: RowForm, min_len: int) -> tuple[Var, list[Expr], Expr] | None:
    """For a row task that writes one value a row (a log-sum-exp over a vocabulary, kept as a
    size-1 dim) whose statistics' top reductions all reduce one static number L >= `min_len`
    of elements: (e', stats, result), with e' the element of a run of L, each such reduction
    rewritten as a reduction over e' (as `row_form` does over a row), and the result at the
    row's one element; else None."""
    if form.row_len != 1:
        return None
    reduces = [r for value in form.stats for r in top_reduces(value)]
    extents = {numel([a.extent for a in r.axes]) if all(isinstance(a.extent, int) for a in r.axes) else None
               for r in reduces}
    if not reduces or len(extents) != 1:
        return None
    (length,) = extents
    if length is None or length < min_len:
        return None
    run = Var("e", length)
    stats = [simplify(_row_reduces(value, run, length)) for value in form.stats]
    result = simplify(substitute(form.result, {id(form.e): Const(0, dtypes.int64)}))
    return run, stats, result


def online_sums(stats: list[Expr], scalars: list[TensorInput], e: Var) -> dict[int, Reduce]:
    """The statistics a kernel may compute in one pass over the row with the sum of
    exponentials that follows them (online softmax): {k: the sum}, where `stats[k]` is the
    float32 maximum over the row of some x and a later statistic holds the float32 sum over
    the row of exp(x - c), c the same for the whole row and read of the maximum (`scalars[k]`;
    softmax's and log-sum-exp's c is the maximum itself, or 0 where it is infinite)."""
    found = {}
    for k, high in enumerate(stats):
        if not (isinstance(high, Reduce) and high.op == "max" and high.axes == (e,)
                and high.body.dtype == dtypes.float32):
            continue
        mine = Load(scalars[k], ()).key()
        unknown = {Load(t, ()).key() for t in scalars[k + 1:]}       # not yet computed with the maximum
        for later in stats[k + 1:]:
            total = next((r for r in top_reduces(later) if _exp_of_shifted(r, high.body, mine, unknown, e)), None)
            if total is not None:
                found[k] = total
                break
    return found


def _exp_of_shifted(r: Reduce, x: Expr, high_key, unknown: set, e: Var) -> bool:
    """Whether `r` is the float32 sum over the row `e` of exp(x - c), c row-uniform, reading
    the load of key `high_key` (a statistic's scalar) and none of keys `unknown`."""
    body = r.body
    if not (r.op == "sum" and r.axes == (e,) and isinstance(body, Unary) and body.op == "exp"
            and body.dtype == dtypes.float32 and isinstance(body.a, Binary) and body.a.op == "sub"):
        return False
    shift = body.a.b
    reads = {y.key() for y in walk(shift) if isinstance(y, Load)}
    return body.a.a.key() == x.key() and row_uniform(shift, e) and high_key in reads and not reads & unknown
