"""Kernel-writing helpers shared by the rules of the CUDA auto-scheduler.

The auto-scheduler is an ordered list of rules (`kiln.schedule.choose.AUTO_RULES`): column
reductions (`kiln.schedule.cuda_columns`), row kernels (`kiln.schedule.cuda_rows`), split
reductions (`kiln.schedule.cuda_split`) and the general kernel (`kiln.schedule.cuda_general`);
each takes a lowered task (see `kiln.ir.inline`) and returns its CudaProgram, or None where it
does not apply. They share what is here:

- `AutoProgram` collects a program's kernels, argument names, strides and temporaries;
- `buffer_kernel` writes the kernel of one materialized compute: a grid-stride loop over its
  output elements, the grid sized from the multiprocessor count at launch. How one element's
  reductions run depends on their length (`choose_mode`):
  `thread`: one thread per element, reducing sequentially (injective computes and short
  reductions over many elements); `warp`: one warp per element, lanes striding over the
  reduction, combined by warp shuffles; `block`: one block per element, warps combined through
  shared memory (long rows);
- `CudaEmitter` spreads an element's outermost reductions over the lanes of a warp or block.

A lane summing more than PARTIAL_LENGTH float values sums them in partial sums of that many,
so that its error does not grow with the row's length (always, for a symbolic length).

Symbolic sizes are kernel arguments (`kiln.codegen.sizes`), shared by a program's kernels; each
kernel declares those it reads, after its buffers.

A task's row stores (`kiln.ir.row_stores`, offsets distinct) are written by `AutoProgram`'s
kernels: the thread that writes element o of the later of a store's two buffers (the rows or
the offsets) then copies rows[o] to offsets[o] in the store's output, both read back from what
that thread or an earlier kernel wrote.
"""
from __future__ import annotations

from dataclasses import dataclass

from kiln import dtypes
from kiln.codegen.cuda import CudaDialect
from kiln.codegen.emitter import Emitter, KernelArgs, numel, reduce_init, row_major_strides
from kiln.codegen.sizes import SizeArgs
from kiln.ir.compute import Compute, TensorInput
from kiln.ir.expr import Expr, Reduce, SizeVar, Var, as_expr, top_reduces, walk
from kiln.ir.inline import Lowered, substitute
from kiln.ir.simplify import bounds, simplify
from kiln.ir.size import SymSize, as_dim
from kiln.runtime.cuda import CudaProgram, Launch
from kiln.schedule.store_rows import row_store, stores_after

BLOCK = 256
# where each thread's grid-stride loop over work items starts, and its step, by mode
ITEM_LOOP = {
    "thread": ("(int64_t)blockIdx.x * blockDim.x + threadIdx.x", "(int64_t)gridDim.x * blockDim.x"),
    "warp": ("((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5", "((int64_t)gridDim.x * blockDim.x) >> 5"),
    "block": ("(int64_t)blockIdx.x", "(int64_t)gridDim.x"),
}
THREAD_WAVES = 2048 // BLOCK * 4   # blocks a multiprocessor at most of a grid of a thread per element
PARTIAL_LENGTH = 256            # a lane's float sum of more values goes through partial sums
TARGET_BLOCKS = 8 * 132         # blocks of BLOCK threads filling an H100/H200 (132 SMs) once: a
                                # reduction split into parts aims at this many


def reduce_extent(r: Reduce) -> int:
    """An upper bound of the number of values `r` reduces (dynamic extents by their bounds)."""
    n = 1
    for axis in r.axes:
        if isinstance(axis.extent, Expr):
            b = bounds(axis.extent)
            n *= max(b[1], 1) if b is not None else 1 << 20
        else:
            n *= axis.extent
    return n


def symbolic_extent(r: Reduce) -> bool:
    """Whether the number of values `r` reduces depends on a symbolic size."""
    return any(isinstance(a.extent, SymSize) or (isinstance(a.extent, Expr) and
                                                 any(isinstance(x, SizeVar) for x in walk(a.extent)))
               for a in r.axes)


def choose_mode(elements: int, extent: int) -> str:
    """How to run one element's reductions: 'thread', 'warp' or 'block'."""
    if extent == 0 or (extent <= 32 and elements >= 8192):
        return "thread"
    if extent <= 2048 and elements >= 512:
        return "warp"
    return "block"


class CudaEmitter(Emitter):
    """An emitter whose outermost reductions are spread over the lanes of a warp or block.

    `mode` is 'thread' (sequential reductions), 'warp' or 'block'. In `split` form the lanes
    cover only the slice `[split_lo, split_hi)` of the flattened reduction.
    """

    def __init__(self, dialect, names, strides, mode: str, indent: int = 1, split: tuple[str, str] | None = None,
                 split_extent: int | None = None, sizes: SizeArgs | None = None):
        super().__init__(dialect, names, strides, indent, sizes)
        self.mode = mode
        self.depth = 0
        self.split = split
        self.split_extent = split_extent        # the values one part of a split reduction covers

    def _reduce(self, e: Reduce, key) -> str:
        if self.depth > 0 or self.mode == "thread":
            self.depth += 1
            try:
                return super()._reduce(e, key)
            finally:
                self.depth -= 1
        self.depth += 1
        try:
            return self._parallel_reduce(e, key)
        finally:
            self.depth -= 1

    def open_partial(self, op: str, t, acc: str, per_lane: int) -> tuple[str, str] | None:
        """For a float sum of more than PARTIAL_LENGTH values a lane: declare a partial sum and
        its count, so that a lane's values do not accumulate in one long sequence."""
        if op != "sum" or not t.is_float or per_lane <= PARTIAL_LENGTH:
            return None
        part, count = self.fresh("part"), self.fresh("n")
        self.line(f"{self.dialect.value_type(t)} {part} = {reduce_init(op, t, self.dialect)}; int {count} = 0;")
        return part, count

    def add_partial(self, partial: tuple[str, str] | None, op: str, t, acc: str, v: str) -> None:
        """Fold `v` into the partial sum (flushed into `acc` every PARTIAL_LENGTH values), or
        into `acc` when there is none."""
        d = self.dialect
        if partial is None:
            self.line(d.combine(op, t, acc, v))
            return
        part, count = partial
        self.line(d.combine(op, t, part, v))
        self.line(f"if (++{count} == {PARTIAL_LENGTH}) {{ {acc} += {part}; {part} = 0; {count} = 0; }}")

    def close_partial(self, partial: tuple[str, str] | None, acc: str) -> None:
        if partial is not None:
            self.line(f"{acc} += {partial[0]};")

    def _parallel_reduce(self, e: Reduce, key) -> str:
        d = self.dialect
        t = e.body.dtype
        vt = d.value_type(t)
        arg = e.op in ("argmax", "argmin")
        acc = self.fresh("acc")
        self.line(f"{vt} {acc} = {reduce_init(e.op, t, d)};")
        pos = self.fresh("pos")
        if arg:
            self.line(f"int64_t {pos} = 0;")
        extents = [self.emit(as_expr(a.extent, dtypes.int64)) for a in e.axes]
        total = " * ".join(f"(int64_t)({x})" for x in extents) or "1"
        lane, width = ("(threadIdx.x & 31)", "32") if self.mode == "warp" else ("threadIdx.x", "blockDim.x")
        flat = self.fresh("f")
        lo, hi = (self.split if self.split else ("0", total))
        lanes = 32 if self.mode == "warp" else BLOCK
        per_lane = -(-min(reduce_extent(e), self.split_extent or reduce_extent(e)) // lanes)
        if symbolic_extent(e):
            per_lane = PARTIAL_LENGTH + 1
        partial = None if arg else self.open_partial(e.op, t, acc, per_lane)
        self.line("#pragma unroll 4")
        self.open(f"for (int64_t {flat} = {lo} + {lane}; {flat} < {hi}; {flat} += {width})")
        self.unravel(e.axes, extents, flat)
        v = self.emit(e.body)
        if arg:
            self.open(f"if ({d.arg_better(e.op, t, v, acc)})")
            self.line(f"{acc} = {v}; {pos} = {flat};")
            self.close()
        else:
            self.add_partial(partial, e.op, t, acc, v)
        self.close()
        self.close_partial(partial, acc)
        self._combine_lanes(e.op, t, acc, pos if arg else None)
        result = pos if arg else acc
        self.scopes[-1][key] = result
        return result

    def unravel(self, axes, extents: list[str], flat: str) -> None:
        """Declare reduction `axes` (row-major, of C `extents`) unravelled from the C flat index
        `flat`, by successive divisions, each remainder taken as `rest - quotient * extent`:
        NVRTC 13.0 and 13.5 crash (segfault, in NVVM) on the `%` and `/` form when the axes'
        strides are multiples of each other (MobileNetV3's channels-last average pool:
        (f / 14) * 9408 + (f % 14) * 672)."""
        rest = flat
        for k, (axis, extent) in enumerate(reversed(list(zip(axes, extents)))):
            name = self.fresh("r")
            self.names[id(axis)] = name
            if k == len(axes) - 1:
                self.line(f"const int64_t {name} = {rest};")
                continue
            quotient = self.fresh("q")
            self.line(f"const int64_t {quotient} = {rest} / ({extent});")
            self.line(f"const int64_t {name} = {rest} - {quotient} * ({extent});")
            rest = quotient

    def _combine_lanes(self, op: str, t, acc: str, pos: str | None) -> None:
        """Leave the combination of every lane's (acc, pos) in every lane."""
        d = self.dialect

        def fold(others: list[str]) -> None:
            if pos is None:
                self.line(d.combine(op, t, acc, others[0]))
                return
            other, other_pos = others
            better = d.arg_better(op, t, other, acc)
            tie = d.arg_tie(t, other, acc)
            self.open(f"if ({better} || ({tie} && {other_pos} < {pos}))")
            self.line(f"{acc} = {other}; {pos} = {other_pos};")
            self.close()

        self.fold_lanes([(acc, t, "sh")] + ([(pos, dtypes.int64, "sp")] if pos is not None else []), fold)

    def fold_lanes(self, values: list[tuple[str, dtypes.DataType, str]], fold,
                   identities: list[str] | None = None) -> None:
        """Leave in every lane the fold of every lane's `values` ((C name, type, the stem of its
        shared array's name) triples): `fold(others)` emits the statements folding `others` (the
        C expressions of another lane's values, in the same order) into the names; across a warp
        by shuffles, then across a block's warps through shared memory: each warp folds the
        warps' values in turn or, given the values' `identities` (C expressions), as a warp of
        them (lane k takes warp k's), by shuffles again: five folds a warp instead of one a
        warp of the block, for folds that cost much (the online softmax's exponentials)."""
        d = self.dialect

        def across_warp() -> None:
            self.open("for (int kiln_m = 16; kiln_m > 0; kiln_m >>= 1)")
            others = []
            for name, t, _ in values:
                other = self.fresh("o")
                self.line(f"const {d.value_type(t)} {other} = {d.shuffle_xor(t, name, 'kiln_m')};")
                others.append(other)
            fold(others)
            self.close()

        across_warp()
        if self.mode != "block":
            return
        shared = []
        for _, t, stem in values:
            shared.append(self.fresh(stem))
            self.line(f"__shared__ {d.value_type(t)} {shared[-1]}[32];")
        self.line("__syncthreads();")
        stores = " ".join(f"{sh}[threadIdx.x >> 5] = {name};" for sh, (name, _, _) in zip(shared, values))
        self.line(f"if ((threadIdx.x & 31) == 0) {{ {stores} }}")
        self.line("__syncthreads();")
        if identities is not None:
            warp = "(threadIdx.x & 31) < (blockDim.x >> 5)"
            self.line(" ".join(f"{name} = {warp} ? {sh}[threadIdx.x & 31] : {identity};"
                               for sh, (name, _, _), identity in zip(shared, values, identities)))
            across_warp()
            return
        self.line(" ".join(f"{name} = {sh}[0];" for sh, (name, _, _) in zip(shared, values)))
        self.open("for (int kiln_w = 1; kiln_w < (int)(blockDim.x >> 5); ++kiln_w)")
        fold([f"{sh}[kiln_w]" for sh in shared])
        self.close()


@dataclass
class Kernel:
    """One kernel's source and its launch; `alignment`: the bytes its pointers must be a
    multiple of (packed accesses, `kiln.schedule.cuda_streams`)."""

    source: str
    launch: Launch
    alignment: int = 1


def signature(d: CudaDialect, args: list[tuple[str, object, bool]]) -> str:
    """The parameter list of a kernel over `args`: (name, tensor, read-only) triples."""
    params = []
    for name, t, const in args:
        qual = "const " if const else ""
        params.append(f"{qual}{d.storage_type(t.dtype)}* __restrict__ {name}")
    return ", ".join(params)


def item_loop_kernel(name: str, threads: int, args: list, mode: str, items: int, body: str,
                     sizes: SizeArgs) -> tuple[str, tuple[str, ...]]:
    """The source of kernel `name` over `args` running `body` for each work item `o` below
    `items`: a thread, a warp or a block per item by `mode`, in a grid-stride loop; and the
    size parameters (of `sizes`) it takes after `args`."""
    start, step = ITEM_LOOP[mode]
    loop = f"    for (int64_t o = {start}; o < {sizes.text(items)}; o += {step}) {{\n{body}\n    }}\n}}\n"
    used = sizes.used_in(loop)
    params = ", ".join([signature(CudaDialect(), args)] + sizes.declarations(used))
    return f'extern "C" __global__ void __launch_bounds__({threads}) {name}({params}) {{\n' + loop, tuple(used)


def at_item(buf: Compute, value: Expr, names: dict) -> tuple[Expr, dict]:
    """`value` (an expression of `buf`'s axes) at the work item `o`, the flat row-major index of
    an element of `buf`, and `names` with `o` named."""
    o = Var("o", numel(buf.shape))
    index, stride = {}, 1
    for axis, size in reversed(list(zip(buf.axes, buf.shape))):
        index[id(axis)] = simplify((o // stride) % size) if size != 1 else as_expr(0, dtypes.int64)
        stride *= size
    return simplify(substitute(value, index)), {**names, id(o): "o"}


def buffer_kernel(lowered_names: dict, strides: dict, args: list, buf: Compute, out_name: str,
                   kernel_name: str, sizes: SizeArgs, split: tuple[int, int] | None = None, after: str = "") -> Kernel:
    """The kernel writing every element of `buf` (or, with `split` = (parts, extent), the
    partial reductions of its single outermost reduction), its symbolic sizes in `sizes`;
    `after`: statements run after each element's store, by the thread that stores it."""
    d = CudaDialect()
    items = numel(buf.shape)
    reduces = top_reduces(buf.value)
    extent = max((reduce_extent(r) for r in reduces), default=0)
    mode = "block" if split else choose_mode(items, extent)
    value, names = at_item(buf, buf.value, lowered_names)
    split_bounds = None
    if split:
        parts, total = split
        chunk = sizes.text(-(-total // parts))
        split_bounds = (f"(int64_t)blockIdx.y * {chunk}",
                        f"min((int64_t)(blockIdx.y + 1) * {chunk}, (int64_t){sizes.text(total)})")
        value = top_reduces(value)[0]
    em = CudaEmitter(d, names, strides, mode, indent=2, split=split_bounds,
                     split_extent=-(-split[1] // split[0]) if split else None, sizes=sizes)
    per_block = {"thread": BLOCK, "warp": BLOCK // 32, "block": 1}[mode]
    v = em.emit(value)
    if split:
        store = f"{out_name}[o * {split[0]} + blockIdx.y] = {d.store(value.dtype, v)};"
    else:
        store = f"{out_name}[o] = {d.store(buf.dtype, v)};"
    if after:
        store = f"{{ {store} {after} }}"
    if mode != "thread":
        store = f"if ({'(threadIdx.x & 31)' if mode == 'warp' else 'threadIdx.x'} == 0) {store}"
    body = "\n".join(em.lines) + f"\n        {store}"
    source, used = item_loop_kernel(kernel_name, BLOCK, args, mode, items, body, sizes)
    names = tuple(n for n, _, _ in args) + used
    if split:
        launch = Launch(kernel_name, names, (BLOCK, 1, 1), grid=(as_dim(items), split[0], 1))
    else:
        launch = Launch(kernel_name, names, (BLOCK, 1, 1), items=as_dim(items),
                        per_block=per_block, waves=THREAD_WAVES if mode == "thread" else 64)
    return Kernel(source, launch)


def injective_kernel(lowered_names: dict, strides: dict, args: list, bufs: list[Compute], out_names: list[str],
                     kernel_name: str, sizes: SizeArgs, after: list[str] | None = None) -> Kernel:
    """One kernel writing every element of each of `bufs`, injective computes none of which
    reads another: a thread per element of the largest, each buffer's element under its own
    bound (their sizes are plain ints, or all the same symbolic size); `after[k]`: statements
    run after each element's store of `bufs[k]`."""
    d = CudaDialect()
    counts = [numel(b.shape) for b in bufs]
    items = max(counts)
    parts = []
    for buf, out_name, count, then in zip(bufs, out_names, counts, after or [""] * len(bufs)):
        value, names = at_item(buf, buf.value, lowered_names)
        em = CudaEmitter(d, names, strides, "thread", indent=3, sizes=sizes)
        v = em.emit(value)
        lines = "\n".join(em.lines + [f"            {out_name}[o] = {d.store(buf.dtype, v)};"]
                          + ([f"            {then}"] if then else []))
        guard = "" if sizes.text(count) == sizes.text(items) else f"if (o < {sizes.text(count)}) "
        parts.append(f"        {guard}{{\n{lines}\n        }}")
    source, used = item_loop_kernel(kernel_name, BLOCK, args, "thread", items, "\n".join(parts), sizes)
    launch = Launch(kernel_name, tuple(n for n, _, _ in args) + used, (BLOCK, 1, 1), items=as_dim(items),
                    per_block=BLOCK, waves=THREAD_WAVES)
    return Kernel(source, launch)


class AutoProgram:
    """The kernels of a lowered task as the auto-scheduler writes them, in order.

    Every tensor has its kernel argument name (`names`, by id) and row-major strides;
    `available` lists the (name, tensor, read-only) arguments a next kernel may take: the
    task's inputs and every buffer already written; `sizes` the program's symbolic sizes.
    """

    def __init__(self, lowered: Lowered):
        self.lowered = lowered
        self.names = KernelArgs.names(lowered.inputs, lowered.outputs, lowered.temporaries)
        self.strides = {id(t): row_major_strides(t.shape) for t in lowered.inputs + lowered.buffers}
        self.temporaries = [(tuple(map(as_dim, t.shape)), t.dtype) for t in lowered.temporaries]
        self.available = [(self.names[id(t)], t, True) for t in lowered.inputs]
        self.kernels: list[Kernel] = []
        self.sizes = SizeArgs()

    def temporary(self, shape: tuple[int, ...], dtype) -> TensorInput:
        """A new temporary buffer of the program, as a tensor its kernels can load."""
        t = TensorInput(KernelArgs.temporary(len(self.temporaries)), shape, dtype)
        self.names[id(t)] = t.name
        self.strides[id(t)] = row_major_strides(shape)
        self.temporaries.append((tuple(map(as_dim, shape)), dtype))
        return t

    def write(self, n: int, buf: Compute, out_name: str | None = None) -> None:
        """Add the kernel writing every element of `buf`, the task's n-th buffer (to `out_name`,
        by default its own argument)."""
        out_name = out_name or self.names[id(buf)]
        stored, (after,) = self._row_stores([buf])
        self.kernels.append(buffer_kernel(self.names, self.strides, self.available + [(out_name, buf, False)] + stored,
                                          buf, out_name, f"kiln_k{n}", self.sizes, after=after))
        self.available = self.available + [(out_name, buf, True)]

    def write_together(self, n: int, bufs: list[Compute]) -> None:
        """Add one kernel writing the injective buffers `bufs` (the task's n-th and those after
        it), none of which reads another (`injective_kernel`)."""
        out_names = [self.names[id(b)] for b in bufs]
        stored, after = self._row_stores(bufs)
        args = self.available + [(name, b, False) for name, b in zip(out_names, bufs)] + stored
        self.kernels.append(injective_kernel(self.names, self.strides, args, bufs, out_names, f"kiln_k{n}",
                                             self.sizes, after))
        self.available = self.available + [(name, b, True) for name, b in zip(out_names, bufs)]

    def _row_stores(self, bufs: list[Compute]) -> tuple[list, list[str]]:
        """The kernel arguments (name, tensor, read-only) of the outputs that the row stores
        (`kiln.ir.row_stores`) completed by writing `bufs` store into, and for each of `bufs`
        the statements of those it completes (run by the thread writing its element o)."""
        lowered, args, after = self.lowered, [], []
        for buf in bufs:
            stores = stores_after(lowered, buf)
            for store in stores:
                out = lowered.outputs[store.output]
                args.append((self.names[id(out)], out, False))
            after.append(" ".join(row_store(lowered, store, self.names, "o") for store in stores))
        return args, after

    def program(self) -> CudaProgram:
        source = CudaDialect().prelude + "\n" + "\n".join(k.source for k in self.kernels)
        return CudaProgram(source, [k.launch for k in self.kernels], self.temporaries,
                           alignment=max((k.alignment for k in self.kernels), default=1), sizes=self.sizes.values)
