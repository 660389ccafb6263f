"""The auto-scheduler's row-kernel rule: tasks whose other buffers are per-row statistics.

Softmax's max and sum, layer_norm's mean and variance, RMSNorm's mean of squares: each
statistic is read only at its consumers' own leading indices (`kiln.schedule.rows`), so one
kernel computes a row's statistics into registers and then writes the row (tasks of fewer
than MIN_ROWS rows longer than SHORT_ROW get the general kernels instead, which write the
output over the whole GPU after the statistics); a
statistic that is an output of the task too (a layer norm's mean and rstd, saved for the
backward) is written by the row's first thread as soon as it is known. An element-wise task
(one injective output) is a row task without statistics: rows of at least ELEMENTWISE_ROW
elements, written in packs, each row's index arithmetic done once. A warp
takes a row of up to 32 * ROW_WARP_PACKS packs (several rows per block), a block a longer one
(sized for about ROW_BLOCK_PACKS packs a thread), or an element-wise task's row where a warp a
row would give fewer than ELEMENTWISE_THREADS threads.

Every phase (each statistic's reduction, then the output) walks the same elements of the row
per thread: chunks `c` of `V` consecutive elements at `(c * lanes + lane) * V`. A load that
reads element `b + e` of its tensor (`e` the element of the row, `b` a multiple of V, in bounds
for every row) is a *stream* (`kiln.schedule.cuda_streams`), read as one aligned pack of V
values (16 bytes for the narrowest type); the output is written the same way. Streams the
statistics read are loaded once, at the start of the row, into registers when they fit in
ROW_CACHE_BYTES a thread, so the input comes from DRAM once; other loads (broadcasts,
transposed reads) stay scalar. Vector kernels ask the runtime for aligned pointers
(`CudaProgram.alignment`). Where they do not fit, a maximum over the row and the sum of
exp(x - maximum) that follows it (softmax's, log-sum-exp's: `kiln.schedule.rows.online_sums`)
take one pass over the row together (online softmax: each thread's sum is rescaled as its
maximum grows), for rows of a static length whose lanes sum PARTIAL_LENGTH values at most. A
thread reads its chunks there in groups of ONLINE_GROUP_PACKS packs, loaded before any is used,
so that several loads are in flight while the group before is reduced (`online_plan`,
`RowEmitter.online_statistic`).

A row of at least PEEL_ROW elements whose length or offsets are not multiples of the vector
width (GPT-2's 50,257 logits a row) is *peeled* where its loads share the output's phase (see
`kiln.schedule.cuda_streams`): `kiln_shift` is the row's offset modulo V, chunk `c` of a thread
starts at row element `(c * lanes + lane) * V - kiln_shift` (an aligned pack), and the elements
of a chunk before the row or past its end are skipped: they add nothing to the statistics, read
no scalar load, and are not written (a chunk the row does not fill is stored element by
element, its neighbours belonging to other rows). A task that writes one value a row
(cross-entropy's log-sum-exp over a vocabulary) walks its statistics' reductions as the row
(`run_of_reductions`), in the phase most of their loads share. Otherwise V is 1 where the row
length or an offset is not a multiple of the vector width.

The output phase does as little arithmetic as it can (16-bit rows stay memory-bound): what is
the same for the whole row is computed once a row (a division by a statistic becomes a
multiplication by its reciprocal), and costly values the statistics computed for each element
(softmax's exp(x - max)) stay in registers.

A row of symbolic length (`kiln.ir.size`) gets a plan that is the same at every length of its
regime (a warp, or a block of BLOCK threads): scalar elements, a loop over the thread's chunks
to the run-time length, no registers kept; sizes are kernel arguments (`kiln.codegen.sizes`).
"""
from __future__ import annotations

from dataclasses import dataclass

from kiln.codegen.cuda import CudaDialect
from kiln import dtypes
from kiln.codegen.emitter import reduce_init
from kiln.ir.expr import Cast, Const, Expr, Load, Reduce, Var, as_expr, top_reduces, walk
from kiln.ir.inline import Lowered
from kiln.ir.simplify import simplify
from kiln.ir.size import SymSize, as_dim
from kiln.runtime.cuda import CudaProgram, Launch
from kiln.schedule.cuda_kernels import (BLOCK, PARTIAL_LENGTH, TARGET_BLOCKS, AutoProgram, CudaEmitter,
                                       item_loop_kernel, reduce_extent, symbolic_extent)
from kiln.schedule.cuda_streams import (MAX_VECTOR, candidate_bases, find_streams, pack_alignment, pack_type,
                                        read_pack)
from kiln.schedule.rows import (elementwise_prefix, online_sums, reciprocals, row_form, row_task,
                               row_uniform_parts, run_of_reductions, shared_parts)

ROW_WARP_PACKS = 8       # a warp takes rows of up to 32 * this many packs, a block longer ones
ROW_BLOCK_PACKS = 2      # a block per row has about this many packs per thread (<= 1024 threads)
ROW_CACHE_BYTES = 256    # registers a thread may give the statistics' streams (values, 4 bytes each at least)
ROW_KEEP_BYTES = 128     # registers a thread may give values kept for the output (exp(x - max))
ROW_UNROLL_MAX = 64      # elements per thread at most for that (its loops unroll fully)
MIN_ROWS = 64            # fewer rows than this would leave most multiprocessors idle
SHORT_ROW = 8192         # unless each is this short: one block then writes a row faster than a second launch
ELEMENTWISE_ROW = 128    # an element-wise task's rows hold this many elements at least
ELEMENTWISE_THREADS = 32768  # an element-wise task of too few rows for this many threads a warp each
                             # gives each row a block
ONLINE_GROUP_PACKS = 4   # packs a thread loads at once in the one-pass maximum and sum (loads in flight)
ONLINE_LANES = 512       # threads a row at most in that pass, where the rows fill the GPU without more
PEEL_ROW = 1024          # rows this long at least are read in packs of their loads' phase (see the module doc)


@dataclass(frozen=True)
class RowPlan:
    """How a row kernel covers a row: `lanes` threads (a warp or a block), `vector` elements
    a pack, `chunks` packs a thread; `cached`: the statistics' streams stay in registers;
    `peeled`: the row's packs start `kiln_shift` elements before it (see the module doc)."""

    row_len: int
    vector: int
    lanes: int
    chunks: int
    cached: bool
    peeled: bool = False

    @property
    def warp(self) -> bool:
        return self.lanes == 32

    @property
    def lane(self) -> str:
        return "(threadIdx.x & 31)" if self.warp else "threadIdx.x"

    @property
    def guarded(self) -> bool:
        """Whether some chunk of some thread lies past the row's end (at some length, for a
        symbolic one)."""
        return (self.peeled or isinstance(self.row_len, SymSize)
                or self.lanes * self.chunks * self.vector != self.row_len)


def plan_row(row_len: int, vector: int, cached_bytes: int, min_lanes: int = 32, reduced: int = 0,
             peeled: bool = False) -> RowPlan:
    """The plan for rows of `row_len` elements in packs of `vector`; `cached_bytes` is what one
    pack of every stream the statistics read takes in registers; a row gets `min_lanes` threads
    at least where it has that many packs, and a block where its statistics reduce more than
    a warp's share of elements (`reduced`: the longest reduction; a log-sum-exp over a
    vocabulary writes one value a row). A symbolic length's plan depends on its value only
    through the choice of a warp or a block (see the module doc). A `peeled` row spans one
    pack more where its shift takes its last elements into another."""
    if isinstance(row_len, SymSize):
        lanes = 32 if row_len <= 32 * ROW_WARP_PACKS else BLOCK
        return RowPlan(row_len, 1, lanes, (row_len + lanes - 1) // lanes, False)
    packs = -(-(row_len + (vector - 1 if peeled else 0)) // vector)
    if packs <= 32 * ROW_WARP_PACKS:
        lanes = 32
    else:
        lanes = min(1024, -(-packs // (32 * ROW_BLOCK_PACKS)) * 32)
    if lanes < min_lanes:
        lanes = min(1024, -(-min(min_lanes, packs) // 32) * 32)
    if reduced > 32 * ROW_WARP_PACKS * MAX_VECTOR:
        lanes = max(lanes, min(1024, -(-reduced // (32 * ROW_BLOCK_PACKS * MAX_VECTOR)) * 32))
    chunks = -(-packs // lanes)
    threads = BLOCK if lanes == 32 else lanes
    budget = min(ROW_CACHE_BYTES, 2 * 65536 // threads)     # half the registers a thread may have
    cached = chunks * cached_bytes <= budget and chunks * vector <= ROW_UNROLL_MAX
    return RowPlan(row_len, vector, lanes, chunks, cached, peeled)


class RowEmitter(CudaEmitter):
    """Emits a row kernel's phases over the thread's elements of the row (see the module doc).

    `streams` maps each vectorized load (by key) to its Stream; `cache` maps the streams kept
    in registers to their pack arrays.
    """

    def __init__(self, dialect, names, strides, plan: RowPlan, e: Var, streams: dict, cache: dict, sizes):
        super().__init__(dialect, names, strides, "warp" if plan.warp else "block", indent=2, sizes=sizes)
        self.plan, self.e = plan, e
        self.streams, self.cache = streams, cache
        self.packs: dict = {}       # stream -> the C expression of its pack in the current chunk
        self.kept: dict = {}        # key -> register array of a value the statistics computed
        self.reuse = False          # whether emitting the output (which reads `kept`)
        self.guarded = False        # whether the open chunk is bounded by the row's end
        self.element_guard = False  # whether the open element is bounded by the row's ends

    def pack_type(self, t) -> str:
        return pack_type(self.dialect, t, self.plan.vector)

    def pack_at(self, stream, eb: str) -> str:
        """The pack of `stream` starting at row element `eb`, read from memory."""
        return read_pack(self.dialect, stream, self.names[id(stream.tensor)], self.emit(stream.base), eb,
                         self.plan.vector)

    def load_cache(self) -> None:
        """Read every cached stream of this row into its register array, as values."""
        if not self.cache:
            return
        d, plan = self.dialect, self.plan
        for stream, array in self.cache.items():
            self.line(f"{d.value_type(stream.tensor.dtype)} {array}[{plan.chunks}][{plan.vector}];")
        self.open_chunk([])
        for stream, array in self.cache.items():
            pack = self.fresh("pk")
            self.line(f"const {self.pack_type(stream.tensor.dtype)} {pack} = {self.pack_at(stream, 'kiln_eb')};")
            self.line("#pragma unroll")
            value = d.load(stream.tensor.dtype, f"{pack}.v[kiln_j]")
            self.line(f"for (int kiln_j = 0; kiln_j < {plan.vector}; ++kiln_j) {array}[kiln_c][kiln_j] = {value};")
        self.close_chunk()

    def open_chunk(self, needed: list, group: int = 0) -> None:
        """Open the loop over this thread's chunks (fully unrolled for a cached plan) or, with
        `group`, over the `group` chunks of the group `kiln_g` (see `online_statistic`: its
        rows are short enough for 32-bit offsets); load the packs of `needed` streams not
        cached."""
        plan = self.plan
        shift = " - kiln_shift" if plan.peeled else ""
        if group:
            self.line("#pragma unroll")
            self.open(f"for (int kiln_u = 0; kiln_u < {group}; ++kiln_u)")
            self.line(f"const int kiln_c = kiln_g * {group} + kiln_u;")
            self.line(f"const int kiln_eb = (kiln_c * {plan.lanes} + (int){plan.lane}) * {plan.vector}{shift};")
        else:
            self.line("#pragma unroll" if plan.cached else "#pragma unroll 2")
            self.open(f"for (int kiln_c = 0; kiln_c < {self.size(plan.chunks)}; ++kiln_c)")
            self.line(f"const int64_t kiln_eb = ((int64_t)kiln_c * {plan.lanes} + {plan.lane}) * {plan.vector}{shift};")
        self.guarded = plan.guarded or (group and group * -(-plan.chunks // group) > plan.chunks)
        if self.guarded:
            self.open(f"if (kiln_eb < {self.size(plan.row_len)})")
        self.packs = {}
        for stream in needed:
            if stream not in self.cache:
                name = self.fresh("pk")
                self.line(f"const {self.pack_type(stream.tensor.dtype)} {name} = {self.pack_at(stream, 'kiln_eb')};")
                self.packs[stream] = name

    def close_chunk(self) -> None:
        if self.guarded:
            self.close()
        self.close()

    def begin_row(self, anchor: Expr | None) -> None:
        """Start the row: a peeled plan's `kiln_shift`, the phase of `anchor` (the flat offset
        of the row's element 0 in the output, or in the loads' tensors)."""
        if self.plan.peeled:
            self.line(f"const int kiln_shift = (int)(({self.emit(anchor)}) & {self.plan.vector - 1});")

    def open_element(self, whole: bool = False) -> None:
        """Open the loop over the chunk's elements, binding `e` (in a peeled row, to the
        elements of the row only, unless the chunk is known to be `whole`ly in it)."""
        self.line("#pragma unroll")
        self.open(f"for (int kiln_j = 0; kiln_j < {self.plan.vector}; ++kiln_j)")
        e = self.names[id(self.e)]
        self.line(f"const int64_t {e} = kiln_eb + kiln_j;")
        self.element_guard = self.plan.peeled and not whole
        if self.element_guard:
            self.open(f"if ((uint64_t){e} < (uint64_t){self.size(self.plan.row_len)})")

    def close_element(self) -> None:
        if self.element_guard:
            self.close()
        self.close()

    def needed(self, e: Expr) -> list:
        """The streams `e` reads, in order of first read."""
        found = [self.streams[x.key()] for x in walk(e) if isinstance(x, Load) and x.key() in self.streams]
        return list(dict.fromkeys(found))

    def emit(self, e: Expr) -> str:
        if isinstance(e, (Const, Var)):
            return super().emit(e)
        key = e.key()
        kept = self.kept.get(key)
        if kept is not None and self.reuse:
            return f"{kept}[kiln_c][kiln_j]"
        found = self._lookup(key)
        if found is not None:
            return found
        if isinstance(e, Load) and key in self.streams:
            stream = self.streams[key]
            if stream in self.cache:
                return self.let(e.dtype, f"{self.cache[stream]}[kiln_c][kiln_j]", key)
            return self.let(e.dtype, self.dialect.load(e.dtype, f"{self.packs[stream]}.v[kiln_j]"), key)
        found = super().emit(e)
        if kept is not None:
            self.line(f"{kept}[kiln_c][kiln_j] = {found};")
        return found

    def keep(self, parts: list[Expr]) -> None:
        """Keep the values of `parts` that the statistics compute for every element in
        registers, for the output to reuse (the row's chunks loop fully unrolled)."""
        for part in parts:
            name = self.fresh("kiln_k")
            self.line(f"{self.dialect.value_type(part.dtype)} {name}[{self.plan.chunks}][{self.plan.vector}];")
            self.kept[part.key()] = name

    def _parallel_reduce(self, r: Reduce, key) -> str:
        if len(r.axes) != 1 or r.axes[0] is not self.e:
            return super()._parallel_reduce(r, key)
        d = self.dialect
        t = r.body.dtype
        arg = r.op in ("argmax", "argmin")
        acc = self.fresh("acc")
        self.line(f"{d.value_type(t)} {acc} = {reduce_init(r.op, t, d)};")
        pos = self.fresh("pos")
        if arg:
            self.line(f"int64_t {pos} = 0;")
        per_lane = PARTIAL_LENGTH + 1 if isinstance(self.plan.row_len, SymSize) else self.plan.chunks * self.plan.vector
        partial = None if arg else self.open_partial(r.op, t, acc, per_lane)
        self.open_chunk(self.needed(r.body))
        self.open_element()
        v = self.emit(r.body)
        if arg:
            self.open(f"if ({d.arg_better(r.op, t, v, acc)})")
            self.line(f"{acc} = {v}; {pos} = {self.names[id(self.e)]};")
            self.close()
        else:
            self.add_partial(partial, r.op, t, acc, v)
        self.close_element()
        self.close_chunk()
        self.close_partial(partial, acc)
        self._combine_lanes(r.op, t, acc, pos if arg else None)
        result = pos if arg else acc
        self.scopes[-1][key] = result
        return result

    def online_statistic(self, high: Reduce, total: Reduce, scalar) -> str:
        """Emit the maximum `high` over the row together with the sum of exponentials `total`
        that reads it (`kiln.schedule.rows.online_sums`), in one pass over the row: each thread
        reads its chunks in groups (`online_groups`), a group's packs all loaded before any is
        used (independent loads in flight), takes the group's maximum and its sum of exp(x -
        maximum) in registers, and folds that pair into its running maximum m and sum s of
        exp(x - m) (rescaling s where m grows); the lanes fold their (m, s) pairs alike. A
        peeled row's packs that lie wholly in the row skip the per-element bounds. The sum is
        taken where `total`'s shift c (read of the maximum, bound to `scalar`) equals the
        finite maximum; elsewhere (an infinite or NaN maximum, another shift) `total` is
        reduced again from the row. Returns the maximum's C name; `total` is bound to the
        sum's."""
        d, plan = self.dialect, self.plan
        unroll, groups = online_groups(plan)
        m, s = self.fresh("hi"), self.fresh("tot")
        self.line(f"float {m} = -INFINITY, {s} = 0.0f;")
        self.line("#pragma unroll 1")
        self.open(f"for (int kiln_g = 0; kiln_g < {groups}; ++kiln_g)")
        packs = {}
        for stream in self.needed(high.body):
            packs[stream] = self.fresh("pk")
            self.line(f"{self.pack_type(stream.tensor.dtype)} {packs[stream]}[{unroll}];")
        self.open_chunk([], unroll)
        for stream, array in packs.items():
            self.line(f"{array}[kiln_u] = {self.pack_at(stream, 'kiln_eb')};")
        self.close_chunk()
        xs = self.fresh("kiln_xs")
        self.line(f"float {xs}[{unroll}][{plan.vector}];")
        self.line("#pragma unroll")
        self.line(f"for (int kiln_j = 0; kiln_j < {unroll * plan.vector}; ++kiln_j) "
                  f"{xs}[kiln_j / {plan.vector}][kiln_j % {plan.vector}] = -INFINITY;")
        self.open_chunk([], unroll)
        self.packs = {stream: f"{array}[kiln_u]" for stream, array in packs.items()}
        for whole in ((True, False) if plan.peeled else (False,)):
            if plan.peeled:
                self.open(f"if (kiln_eb >= 0 && kiln_eb + {plan.vector} <= {self.size(plan.row_len)})" if whole else "else")
            self.open_element(whole)
            self.line(f"{xs}[kiln_u][kiln_j] = {self.emit(high.body)};")
            self.close_element()
            if plan.peeled:
                self.close()
        self.close_chunk()
        part, sums = self.fresh("ph"), self.fresh("gs")
        self.line(f"float {part} = {m}, {sums}[{unroll}];")
        self.line("#pragma unroll")
        self.open(f"for (int kiln_u = 0; kiln_u < {unroll}; ++kiln_u)")
        self.line(f"float kiln_h = {xs}[kiln_u][0];")
        self.line("#pragma unroll")
        self.line(f"for (int kiln_j = 1; kiln_j < {plan.vector}; ++kiln_j) "
                  f"{d.combine('max', high.dtype, 'kiln_h', f'{xs}[kiln_u][kiln_j]')}")
        self.line(d.combine("max", high.dtype, part, "kiln_h"))
        self.close()
        self.open(f"if ({part} != -INFINITY)")
        self.line("#pragma unroll")
        self.open(f"for (int kiln_u = 0; kiln_u < {unroll}; ++kiln_u)")
        self.line(f"{sums}[kiln_u] = 0.0f;")
        self.line("#pragma unroll")
        self.line(f"for (int kiln_j = 0; kiln_j < {plan.vector}; ++kiln_j) "
                  f"{sums}[kiln_u] += {self._exp(f'{xs}[kiln_u][kiln_j] - {part}')};")
        self.close()
        self.line(f"{s} *= {self._exp(f'{m} - {part}')};")
        self.line("#pragma unroll")
        self.line(f"for (int kiln_u = 0; kiln_u < {unroll}; ++kiln_u) {s} += {sums}[kiln_u];")
        self.line(f"{m} = {part};")
        self.close()
        self.close()
        self._combine_online(m, s)
        self.scopes[-1][Load(scalar, ()).key()] = m
        shift = self.emit(total.body.a.b)
        result = self.fresh("tot")
        self.line(f"float {result};")
        self.open(f"if ({shift} == {m} && fabsf({m}) != INFINITY)")
        self.line(f"{result} = {s};")
        self.close()
        self.open("else")
        self.line(f"{result} = {self._parallel_reduce(total, total.key())};")
        self.close()
        self.scopes[-1][total.key()] = result
        return m

    def _combine_online(self, m: str, s: str) -> None:
        """Fold every lane's (maximum, sum of exp(x - maximum)) pair into every lane's."""

        def fold(others: list[str]) -> None:
            om, os = others
            both = self.fresh("hm")
            self.line(f"float {both} = {m};")
            self.line(self.dialect.combine("max", dtypes.float32, both, om))
            self.open(f"if ({both} != -INFINITY)")
            # unfused products: two lanes folding each other's pairs get the same sum
            mine, theirs = self._exp(f"{m} - {both}"), self._exp(f"{om} - {both}")
            self.line(f"{s} = __fmul_rn({s}, {mine}) + __fmul_rn({os}, {theirs});")
            self.line(f"{m} = {both};")
            self.close()

        self.fold_lanes([(m, dtypes.float32, "shm"), (s, dtypes.float32, "shs")], fold, ["-INFINITY", "0.0f"])

    def _exp(self, x: str) -> str:
        """The C expression of the float32 exponential of `x`, as the dialect writes it."""
        return self.dialect.unary("exp", dtypes.float32, x, dtypes.float32)

    def hoist(self, value: Expr) -> None:
        """Emit here (once a row) the largest parts of `value` that are the same for every
        element of the row and read no memory but the row statistics."""
        for part in row_uniform_parts(value, self.e):
            self.emit(part)

    def store_row(self, value: Expr, out, out_name: str, one: bool = False) -> None:
        """Write the output row: each chunk's values packed into one store (a final rounding
        to the output's 16-bit type is the store's own); a chunk a peeled row does not fill,
        element by element. `one`: the output holds one value a row, the row's first thread
        writes it."""
        d, plan = self.dialect, self.plan
        if one:
            v = self.emit(value)
            self.line(f"if ({plan.lane} == 0) {out_name}[o] = {d.store(out.dtype, v)};")
            return
        self.hoist(value)
        self.reuse = True
        self.open_chunk(self.needed(value))
        self.line(f"{self.pack_type(out.dtype)} kiln_st;")
        self.open_element()
        if isinstance(value, Cast) and value.dtype == out.dtype and out.dtype.is_16bit_float:
            v = f"(float)({self.emit(value.a)})"
        else:
            v = self.emit(value)
        self.line(f"kiln_st.v[kiln_j] = {d.store(out.dtype, v)};")
        self.close_element()
        length = self.size(plan.row_len)
        target = f"{out_name} + o * {length} + kiln_eb"
        store = f"*reinterpret_cast<{self.pack_type(out.dtype)}*>({target}) = kiln_st;"
        if plan.peeled:
            self.line(f"if (kiln_eb >= 0 && kiln_eb + {plan.vector} <= {length}) {{ {store} }}")
            self.open("else")
            self.line("#pragma unroll")
            self.line(f"for (int kiln_j = 0; kiln_j < {plan.vector}; ++kiln_j) "
                      f"if ((uint64_t)(kiln_eb + kiln_j) < (uint64_t){length}) ({target})[kiln_j] = kiln_st.v[kiln_j];")
            self.close()
        else:
            self.line(store)
        self.close_chunk()


def online_groups(plan: RowPlan) -> tuple[int, int]:
    """(packs a group, groups) of a thread's chunks in the online pass: as few groups of at
    most ONLINE_GROUP_PACKS packs as cover its chunks, as even as they can be."""
    groups = -(-plan.chunks // ONLINE_GROUP_PACKS)
    return -(-plan.chunks // groups), groups


def _online_row(plan: RowPlan) -> bool:
    """Whether a row of `plan` that its statistics read from memory twice (not cached) takes a
    maximum and its sum of exponentials in one pass: a static length whose lanes sum
    PARTIAL_LENGTH values at most each (the online sum has no partial sums)."""
    return not isinstance(plan.row_len, SymSize) and plan.chunks * plan.vector <= PARTIAL_LENGTH


def online_plan(plan: RowPlan, rows) -> RowPlan:
    """The plan of a row whose statistics take the online pass (`_online_row`), refitted so
    that each thread's chunks make whole groups of ONLINE_GROUP_PACKS (no group reads past the
    row for nothing), a block at most ONLINE_LANES threads where the rows give the GPU
    TARGET_BLOCKS blocks of BLOCK threads so: more rows a multiprocessor, whose folds and
    barriers overlap each other's loads. A warp's row stays a warp's."""
    if plan.warp:
        return plan
    packs = -(-(plan.row_len + (plan.vector - 1 if plan.peeled else 0)) // plan.vector)
    most = plan.lanes
    if not isinstance(rows, SymSize) and rows * ONLINE_LANES >= TARGET_BLOCKS * BLOCK:
        most = min(most, ONLINE_LANES)
    groups = -(-packs // (ONLINE_GROUP_PACKS * most))
    lanes = -(-packs // (ONLINE_GROUP_PACKS * groups * 32)) * 32
    fitted = RowPlan(plan.row_len, plan.vector, lanes, ONLINE_GROUP_PACKS * groups, False, plan.peeled)
    return fitted if lanes > 32 and _online_row(fitted) else plan


def schedule(lowered: Lowered) -> CudaProgram | None:
    """The one-kernel program of a row task or an element-wise one (see the module doc); None
    for any other task."""
    found = row_task(lowered, min_rows=MIN_ROWS, short_row=SHORT_ROW)
    if found is None:
        p = elementwise_prefix(lowered, MIN_ROWS, ELEMENTWISE_ROW)
        found = None if p is None else (lowered.outputs[0], p)
    if found is None:
        return None
    out, p = found
    d = CudaDialect()
    auto = AutoProgram(lowered)
    names, strides = auto.names, auto.strides
    args = auto.available + [(names[id(t)], t, False) for t in lowered.outputs]
    form = row_form(lowered, out, p)
    rows, row_len, o, e, stats = form.rows, form.row_len, form.o, form.e, form.stats
    names.update({id(o): "o", id(e): "e"})
    result = reciprocals(form.result, e)
    run = run_of_reductions(form, PEEL_ROW)
    one = run is not None         # one value a row: the statistics' reductions are the row walked
    if one:
        e, stats, result = run
        row_len = e.extent
        names[id(e)] = "e"
    packed = () if one else (out.dtype,)
    vector, streams = find_streams(stats + [result], strides, e, (o,), row_len, packed)
    anchor = None
    if not isinstance(row_len, SymSize) and row_len >= PEEL_ROW:
        anchors = candidate_bases(stats, strides, e, (o,)) if one else [simplify(o * as_expr(row_len, dtypes.int64))]
        for at in anchors:
            v, found = find_streams(stats + [result], strides, e, (o,), row_len, packed, anchor=at)
            if v > vector and len(found) >= (len(streams) if vector > 1 else 0) and (found or not one):
                anchor, vector, streams = at, v, found
    read_by_stats = []
    for value in stats:
        for x in walk(value):
            if isinstance(x, Load) and x.key() in streams and streams[x.key()] not in read_by_stats:
                read_by_stats.append(streams[x.key()])
    pack_bytes = sum(max(4, s.tensor.dtype.nbytes) * vector for s in read_by_stats)
    reduced = max((reduce_extent(r) for value in stats for r in top_reduces(value) if not symbolic_extent(r)),
                  default=0)
    few = not isinstance(rows, SymSize) and rows < MIN_ROWS         # short rows (SHORT_ROW): a block each
    plan = plan_row(row_len, vector, pack_bytes, (BLOCK if few else 32) if stats else ELEMENTWISE_THREADS // rows,
                    reduced, peeled=anchor is not None)
    online = {} if plan.cached or not _online_row(plan) else online_sums(stats, form.scalars, e)
    if online:
        plan = online_plan(plan, rows)
    cache = {s: f"kiln_x{k}" for k, s in enumerate(read_by_stats)} if plan.cached else {}
    em = RowEmitter(d, names, strides, plan, e, streams, cache, auto.sizes)
    em.begin_row(anchor)
    em.load_cache()
    if plan.cached:
        shared = shared_parts(stats, result, e)
        em.keep(shared[:ROW_KEEP_BYTES // (4 * plan.chunks * plan.vector)])
    for k, (t, scalar, value, written) in enumerate(zip(form.statistics, form.scalars, stats, form.written)):
        v = em.online_statistic(value, online[k], scalar) if k in online else em.emit(value)
        held = em.fresh("row")
        em.line(f"const {d.value_type(t.dtype)} {held} = {v};")
        em.scopes[-1][Load(scalar, ()).key()] = held
        if written:
            em.line(f"if ({plan.lane} == 0) {names[id(t)]}[o] = {d.store(t.dtype, held)};")
    em.store_row(result, out, names[id(out)], one)
    threads = BLOCK if plan.warp else plan.lanes
    source, used = item_loop_kernel("kiln_row", threads, args, "warp" if plan.warp else "block", rows,
                                    "\n".join(em.lines), auto.sizes)
    launch = Launch("kiln_row", tuple(n for n, _, _ in args) + used, (threads, 1, 1), items=as_dim(rows),
                    per_block=threads // 32 if plan.warp else 1, waves=64, narrows=plan.warp)
    tensors = [s.tensor for s in streams.values()] + ([] if one else [out])
    return CudaProgram(d.prelude + "\n" + source, [launch], [], alignment=pack_alignment(tensors, vector),
                       sizes=auto.sizes.values)
