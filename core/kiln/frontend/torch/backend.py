"""The torch.compile backend "kiln" (registered through the `torch_dynamo_backends` entry point).

`kiln_backend(gm, example_inputs, options=None, mode=None)` takes torch.compile's `mode` and
`options` (see `kiln.frontend.torch.config`) and returns a `KilnFunction`, which traces a
FlowGraph when it first sees an input signature, reading the settings then (search_space as
the tuning level of the kernels built by that first run; use_cuda_graph to replay CUDA
graphs), and runs it from then on. Parameters and buffers become constants of the FlowGraph,
sharing memory.

Unmapped operators raise one `UnmappedOperatorError` listing them all, except where the graph
holds what dynamo leaves for AOTAutograd to lower (numpy calls, functorch's vmap): such a graph
is compiled from AOTAutograd's ATen graph, and raises only if that fails or leaves operators
unmapped. A node whose rules all
decline its arguments raises a `MappingError` when the graph first runs. With
`dynamo_config.fallback_to_eager(True)` the backend first finds every node Kiln cannot compile
(`kiln.frontend.torch.partition`: unmapped, declined, unsupported dtypes) and runs those in
PyTorch, named in one warning. Kiln's values have no view semantics: a graph that changes a
tensor in place through a view (`kiln.frontend.torch.aliasing`) is functionalized by
AOTAutograd and its ATen graph compiled by Kiln, the caller's inputs updated after each call as
eager updates them (in PyTorch, with a warning, only where AOTAutograd fails on it); a call
where an input the graph changes in place shares memory with another input (`f(a, a[0])`) runs
in PyTorch, with a warning.

A new input signature that differs from one traced before only in the values of symbolic sizes
runs that trace's plan, its sizes bound to the call's, where every decision the trace made on
those sizes holds at the new values (`kiln.frontend.torch.plan_reuse`); the plan is stored in
the whole-graph cache as a traced one is.

Before it traces a graph for an input signature, a KilnFunction asks the whole-graph cache
(`kiln.frontend.torch.graph_cache`) for the plan compiled before for the same graph, inputs,
settings and code: a hit skips mapping, graph passes, scheduling and rendering. A graph the
cache holds is not checked for unmapped operators when dynamo hands it over (it compiled
before), so a process whose graphs all hit never loads the plugins. `kiln.load(path,
model=...)` compiles a model with a backend whose KilnFunctions take every plan from a file
`kiln.save` wrote, found by the same key (`KilnFunction`'s `saved`).

A graph is compiled under torch's TF32 flags as they are when dynamo hands it over
(`kiln.frontend.torch.config.FROM_TORCH`). Dynamo compiles again when the matmul flag changes,
not when cuDNN's does (`config.UNGUARDED`): a KilnFunction whose plans depend on cuDNN's flag
(float32 convolutions on CUDA: `kiln.passes.tf32.permissions`) reads it at each call and keeps
a plan for each value it has seen; other graphs never read it.
"""
from __future__ import annotations

import contextlib
import threading
import warnings
import weakref
from collections import Counter, OrderedDict
from dataclasses import replace

import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.fx import GraphModule
from torch.fx.node import map_aggregate

from kiln.frontend.torch import graph_cache
from kiln.frontend.torch.complex import unsupported_complex
from kiln.frontend.torch.aliasing import shared_memory, storages, view_mutations
from kiln.frontend.torch.config import dynamo_config
from kiln.frontend.torch.dump import dump_compiled
from kiln.frontend.torch.errors import UnmappedOperatorError
from kiln.frontend.torch.indices import used_only_as_index
from kiln.frontend.torch.interpreter import Interpreter, MappingError, mutates
from kiln.frontend.torch.partition import nodes_for_pytorch, split
from kiln.frontend.torch.plan_reuse import ReusablePlan, fixed_part, neighbours, size_values, sizes_at, sizes_fixed_at
from kiln.frontend.torch.report import correctness_report, input_graph_table
from kiln.frontend.torch.random import draws_random_numbers
from kiln.frontend.torch.run_record import Output, RunRecord
from kiln.frontend.torch.sizes import input_sizes, reads_value, size_ranges
from kiln.frontend.torch.summary import compile_summary, left_to_pytorch, publish
from kiln.frontend.torch.training import compile_for_training, needs_autograd
from kiln.graph import FlowGraph, in_memory_order, trace_from
from kiln.ir import size_reads
from kiln.ir.size import SymSize
from kiln.log import dump_folder, logger, recording, stage
from kiln.passes import MergeIndependentKernels, PassContext, StoreRowsInKernels, UpdateInPlace, optimize
from kiln.passes.graph_pass import target_of
from kiln.passes.instruments import DumpGraph
from kiln.passes.tf32 import permissions
from kiln.runtime.compiled_graph import CompiledGraph
from kiln.runtime.cuda_graph import capture, keeps_graph, moved_inputs, same_addresses, stays_put
from kiln.settings import Settings, applied
from kiln.tensor import Tensor, from_torch, recording_reads, symbol

_warned: set[str] = set()


def kiln_backend(gm: GraphModule, example_inputs, options: dict | None = None,
                 mode: str | None = None, saved=None):
    """Compile a dynamo graph with Kiln under torch.compile's `mode` and `options`; with `saved`
    (see `KilnFunction`), its plans come from a file `kiln.save` wrote instead."""
    settings = dynamo_config.resolve(options, mode)
    followed = dynamo_config.followed(options)
    if settings.print_input_graph:
        print(input_graph_table(gm))
    mutations = view_mutations(gm)
    if mutations:
        return _functionalized(gm, example_inputs, settings, mutations, followed, saved)
    if needs_autograd(gm, example_inputs) or draws_random_numbers(gm):
        return compile_for_training(
            gm, example_inputs,
            lambda graph, examples, lent_from=None, static_inputs=(): compile_graph(
                graph, examples, settings, lent_from=lent_from, static_inputs=static_inputs, followed=followed,
                saved=saved))
    try:
        return compile_graph(gm, example_inputs, settings, constant_placeholders(gm, example_inputs),
                             followed=followed, saved=saved)
    except UnmappedOperatorError as unmapped:
        if not any(map(_left_for_aot, gm.graph.nodes)):
            raise
        return _lowered(gm, example_inputs, settings, unmapped, followed)


def _release_every_graph() -> None:
    """What `torch._dynamo.reset()` calls (a backend's `reset`): every live KilnFunction lets
    go of its plans and CUDA graphs. Dynamo forgets its compiled code, but a function may stay
    reachable (AOTAutograd's autograd.Function classes keep their compiled backward), and its
    captures would keep their memory; called again, it plans again."""
    for function in KilnFunction.live():
        function.release()


kiln_backend.reset = _release_every_graph


def _left_for_aot(node) -> bool:
    """Whether `node` is one of what dynamo leaves in its graph for AOTAutograd to lower, which
    no torch-level rule maps: a call of numpy through `torch._numpy` (dynamo's wrappers),
    functorch's transforms (vmap's batch dimensions), an ATen overload packet."""
    target = node.target
    return node.op == "call_function" and (
        isinstance(target, torch._ops.OpOverloadPacket)
        or getattr(target, "__module__", "").startswith(("torch._functorch", "torch._C._functorch"))
        or (type(target).__module__ == "torch._dynamo.utils" and type(target).__name__.startswith("numpy_")))


def _lowered(gm: GraphModule, example_inputs, settings: Settings, unmapped: UnmappedOperatorError,
             followed: dict | None = None):
    """`gm`, with nodes `_left_for_aot` and others no torch-level rule maps (`unmapped`),
    compiled from AOTAutograd's ATen graph instead, where they are ATen operators; where that
    fails or leaves operators no rule maps, `unmapped` is raised."""
    try:
        return _functionalized(gm, example_inputs, settings, [], followed, lowering=True)
    except Exception as error:
        raise unmapped from error


def _functionalized(gm: GraphModule, example_inputs, settings: Settings, mutations: list[str],
                    followed: dict | None = None, saved=None, lowering: bool = False):
    """`gm`, which changes tensors in place through views (`mutations`), compiled through
    AOTAutograd, whose functionalization rewrites views and in-place changes into pure
    operations and copies the new values into the caller's inputs after each call (without
    autograd, parameters and buffers the graph leaves unchanged are constants, as on the
    torch-level path); where AOTAutograd fails on the graph, `gm` itself, run by PyTorch, with
    a warning. With `lowering` (see `_lowered`), a failure of AOTAutograd raises too (an
    unmapped ATen operator raises in `compile_graph`, as `_lowered` is reached only without
    fallback_to_eager)."""
    functional = []
    constants = (set() if needs_autograd(gm, example_inputs)
                 else constant_placeholders(gm, example_inputs))

    def compile_aten(graph: GraphModule, examples, lent_from=None, static_inputs=()):
        functional.append(graph)
        return compile_graph(graph, examples, settings, _aten_constants(graph, gm, constants), lent_from,
                             static_inputs, followed, saved)

    try:
        return compile_for_training(gm, example_inputs, compile_aten)
    except Exception as error:
        if functional or lowering:      # AOTAutograd succeeded (the error is Kiln's), or lowering failed
            raise
        _warn_once("Kiln runs this graph in PyTorch: it changes tensors in place through views, "
                   f"and AOTAutograd could not functionalize it ({type(error).__name__}: "
                   f"{error}):\n  " + "\n  ".join(mutations))
        return gm.forward


def _aten_constants(graph: GraphModule, gm: GraphModule, constants: set[str]) -> set[str]:
    """The placeholders of AOTAutograd's inference graph `graph` that hold what `constants`
    names in dynamo's `gm` (parameters and buffers) and that the graph does not change; none
    where AOTAutograd did not keep `gm`'s inputs one for one (duplicates removed, aliased inputs
    merged into a base, a seeds input added)."""
    context = torch._guards.TracingContext.try_get()
    meta = context.fw_metadata if context is not None else None
    ours = list(graph.graph.find_nodes(op="placeholder"))
    theirs = list(gm.graph.find_nodes(op="placeholder"))
    if meta is None or not len(ours) == len(theirs) == len(meta.input_info):
        return set()
    return {a.name for a, b, info in zip(ours, theirs, meta.input_info)
            if b.name in constants and not (info.mutates_data or info.mutates_metadata)}


def compile_graph(gm: GraphModule, example_inputs, settings: Settings,
                  constants: set[str] = frozenset(), lent_from: int | None = None, static_inputs=(),
                  followed: dict | None = None, saved=None):
    """`gm` (a dynamo graph, or one of AOTAutograd's ATen graphs) compiled by Kiln, or, with
    fallback_to_eager, split between Kiln and PyTorch; `constants` names the placeholders
    holding parameters and buffers; the outputs from position `lent_from` on (a training
    forward's values saved for the backward, a backward's gradients) are lent by CUDA graphs
    instead of copied; the inputs at positions `static_inputs` (parameters) keep their memory
    from call to call, and CUDA graphs read them in place; the settings `followed` (name ->
    reader of torch's flag: `DynamoConfig.followed`) are read again at each call; the plans come
    from `saved` where given (see `KilnFunction`)."""
    if not settings.fallback_to_eager:
        function = KilnFunction(gm, settings, constants, lent_from=lent_from, static_inputs=static_inputs,
                                followed=followed, saved=saved)
        # a graph the whole-graph cache holds compiled before had every node mapped: its hit
        # needs no mapping rule, and the plugins are not loaded for it; nor for a graph served
        # from a saved file (the file holds its plan, or its first call is an error)
        if saved is None and not function.cached(example_inputs):
            unmapped = Interpreter(gm).unmapped()
            if unmapped:
                raise UnmappedOperatorError(unmapped)
        # a declined node raises at first run
        return function
    # AOTAutograd compiles its graphs under its fake mode, where rules would build fake constants
    with stage("check", f"{len(gm.graph.nodes)} fx nodes"), unset_fake_temporarily():
        for_pytorch = nodes_for_pytorch(gm, example_inputs, constants)
    if not for_pytorch:
        return KilnFunction(gm, settings, constants, lent_from=lent_from, static_inputs=static_inputs,
                            followed=followed, saved=saved)
    reasons = "\n  ".join(f"{n.name}: {why}" for n, why in for_pytorch.items())
    _warn_once(f"Kiln runs these nodes in PyTorch:\n  {reasons}")
    left = left_to_pytorch(gm, for_pytorch)
    return split(gm, set(for_pytorch),
                 lambda part: KilnFunction(part, settings, constants, left, followed=followed, saved=saved))


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, stacklevel=3)


def constant_placeholders(gm: GraphModule, example_inputs) -> set[str]:
    """Names of the placeholders that hold parameters or buffers (constants of the graph)."""
    names = set()
    for node, example in zip((n for n in gm.graph.nodes if n.op == "placeholder"), example_inputs):
        grapharg = node.meta.get("grapharg")
        source = getattr(getattr(grapharg, "source", None), "name", "")
        if isinstance(example, torch.nn.Parameter) or "._buffers[" in str(source):
            names.add(node.name)
    return names


SIGNATURES_KEPT = 32
"""The most input signatures (sizes) a KilnFunction keeps the FlowGraph, memory plan and CUDA
graph of; the least recently used goes first (coming back, it is traced again, from kernels
already built where its sizes are symbolic)."""


class KilnFunction:
    """One dynamo graph compiled by Kiln: a FlowGraph per input signature, traced on first use.

    A graph dynamo traced with symbolic sizes is traced by Kiln with its sizes as
    `kiln.ir.size.SymSize`s: kernels that take sizes as arguments are built once and serve every
    size (see `kiln.schedule.choose`). A new size runs the plan traced at an earlier one where
    that trace read the sizes' values only through comparisons that answer the same at the new
    ones (`kiln.frontend.torch.plan_reuse`); else it is traced again (and once a trace read a
    value otherwise, the later ones record nothing). After a trace whose plan serves other sizes,
    the sizes just past its thresholds are traced ahead where `Settings.plan_ahead` says so.

    `graphs` maps each input signature seen (the last SIGNATURES_KEPT) to its `CompiledRun`;
    `constant_ids` holds the ids of the parameters and buffers it was called with (how
    `kiln.save` finds a model's graphs among the `live()` ones), `frame` the Python frame
    dynamo compiled it from and `compile_id` the id of that compile. Each trace publishes its
    summary (`kiln.frontend.torch.summary`), which lists `left_to_pytorch`: the nodes of a
    graph split for fallback_to_eager that run in PyTorch. The outputs from position
    `lent_from` on (a training forward's saved values, a backward's gradients) are lent by its
    CUDA graphs rather than copied: a replay reuses their memory only once the caller dropped
    them (`kiln.runtime.cuda_graph`). The inputs at positions `static_inputs` (a training
    forward's parameters) are read in place by its CUDA graphs, which are captured again where
    one of them comes at new memory.

    A call where an input the graph changes in place may share memory with another input runs
    `gm` in PyTorch (`kiln.frontend.torch.aliasing.shared_memory`); graphs that change no
    input skip that check.

    `followed` maps settings that torch's flags give and dynamo does not guard (cuDNN's TF32
    flag: `DynamoConfig.followed`) to their flags' readers; each compile reads them. `follows`
    lists those that some plan of the graph depends on (`RunRecord.permissions`, learned as
    plans are made): from then on each call reads their flags, and their values join the key
    of `graphs`, so that a call after a flag changed gets the plan made for the new value.

    With `saved` (`kiln.frontend.torch.persist.SavedGraphs`: the graphs of a file `kiln.save`
    wrote), each signature's plan comes from the file, found by its whole-graph key: nothing is
    mapped, optimized or built (`saved.served(key, args, inputs)` gives the CompiledGraph and
    RunRecord, or raises LoadError)."""

    _live: weakref.WeakSet = weakref.WeakSet()

    def __init__(self, gm: GraphModule, settings: Settings, constants: set[str] = frozenset(),
                 left_to_pytorch: list[dict] | None = None, lent_from: int | None = None, static_inputs=(),
                 followed: dict | None = None, saved=None):
        self.gm = gm
        self.settings = settings
        self.saved = saved
        self.followed = dict(followed or {})
        self.follows: tuple[str, ...] = ()
        self.left_to_pytorch = left_to_pytorch or []
        self.lent_from = lent_from
        self.static_inputs = frozenset(static_inputs)
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        # a parameter or buffer the graph changes in place (a running count, a cache) is an
        # input: as a constant, what is computed from it would be folded at compile time
        changed = _changed_in_place(gm)
        # a one-element input the graph reads the value of (`x.item()`: a module's float that
        # dynamic=True passes as a tensor; a size dynamo took from it) is a constant of the
        # trace, traced again when it changes
        read = [reads_value(n) for n in placeholders]
        self.constant = [(n.name in constants or r) and n not in changed for n, r in zip(placeholders, read)]
        self._read_positions = [k for k, r in enumerate(read) if r and self.constant[k]]
        self._constant_positions = [k for k, c in enumerate(self.constant) if c and k not in self._read_positions]
        self._input_positions = [k for k, c in enumerate(self.constant) if not c]
        # under torch.compile, dynamo's guards fix the shape, dtype and device of an input traced
        # with fixed sizes: only the others tell one call's graph from another's
        guarded = torch._guards.CompileContext.current_compile_id() is not None
        self._keyed_positions = [k for k in self._input_positions if not guarded or _may_vary(placeholders[k])]
        self._constants_state: dict[tuple, tuple] = {}
        # inputs changed in place, checked at each call for memory shared with other inputs
        self._written_positions = [k for k, n in enumerate(placeholders) if n in changed]
        self._other_positions = [k for k in self._input_positions + self._read_positions
                                 if k not in self._written_positions]
        self._constant_storages: dict[tuple, dict[int, list[int]]] = {}
        self._index_positions = {k for k, n in enumerate(placeholders) if used_only_as_index(n)}
        # where dynamo took each input from ("L['x']"), read now: dynamo drops it later
        self.sources = [str(getattr(getattr(n.meta.get("grapharg"), "source", None), "name", ""))
                        for n in placeholders]
        self._names = [source or n.name for source, n in zip(self.sources, placeholders)]
        self.graphs: OrderedDict[tuple, CompiledRun] = OrderedDict()
        # plans traced at symbolic sizes that other sizes may reuse (`plan_reuse`), each with
        # what the call must share with its trace (`_reuse_key`) and the state of the constants
        # it was traced with (`_constants_state`)
        self._reusable: list[tuple[ReusablePlan, tuple, tuple]] = []
        self._records_sizes = True      # until a trace at symbolic sizes read a value (`plan_reuse`)
        self.frame = str(gm.meta.get("dynamo_compile_id", "")).split("/")[0]
        self.compile_id = torch._guards.CompileContext.current_compile_id()
        self.constant_ids: set[int] = set()
        KilnFunction._live.add(self)

    @classmethod
    def live(cls) -> list[KilnFunction]:
        """The KilnFunctions of this process that are still referenced."""
        return list(cls._live)

    def cached(self, args) -> bool:
        """Whether the whole-graph cache holds a plan for the call `args` (real values: fake
        tensors and symbolic sizes, as AOTAutograd passes, are never looked up)."""
        if any(isinstance(a, (FakeTensor, torch.SymInt, torch.SymFloat, torch.SymBool)) for a in args):
            return False
        settings = self.settings_now()
        with applied(settings):
            return graph_cache.holds(self.gm, args, input_sizes(self.gm, args), self.constant,
                                     self._read_positions, settings)

    def settings_now(self) -> Settings:
        """The settings a compile now runs under: `settings`, with the `followed` ones read
        from torch's flags."""
        if not self.followed:
            return self.settings
        return replace(self.settings, **{name: read() for name, read in self.followed.items()})

    def _flags(self) -> tuple:
        """The values of the torch flags `follows` names, read now (none: nothing is read)."""
        return tuple(self.followed[name]() for name in self.follows)

    def __call__(self, *args):
        signature = (tuple(_signature(args[k]) for k in self._keyed_positions) +
                     tuple(args[k].item() for k in self._read_positions))
        key = signature + self._flags()
        # Constants are checked by memory and version (dynamo's guards fix their shapes and
        # dtypes): new memory (`p.data = ...`) or an in-place change (`p.copy_(...)`, an
        # optimizer step; not through `p.data`) traces the graph anew, replacing the old one,
        # since folded constants (merged or transposed weights) hold the values they were
        # computed from.
        constants = [args[k] for k in self._constant_positions]
        compiled = self.graphs.get(key)
        if compiled is None or not _unchanged(constants, self._constants_state[key]):
            # kernels are built (and tuned) by this first run
            compiled = self._compile(args)
            follows = tuple(name for name in self.followed
                            if name in self.follows or name in compiled.record.permissions)
            if follows != self.follows:     # the plans depend on a flag read at each call from now on
                self.follows = follows
                key = signature + self._flags()
            self.graphs[key] = compiled
            self._constants_state[key] = _constants_state(constants)
            self._constant_storages[key] = storages(args, self._constant_positions)
            if len(self.graphs) > SIGNATURES_KEPT:
                oldest, _ = self.graphs.popitem(last=False)
                del self._constants_state[oldest], self._constant_storages[oldest]
        self.graphs.move_to_end(key)
        if self._written_positions:
            shared = shared_memory(args, self._written_positions, self._other_positions,
                                   self._constant_storages[key])
            if shared:
                return self._run_in_pytorch(args, shared)
        return compiled(args)

    def release(self) -> None:
        """Forget every plan (a later call traces again, from the caches) and retire their CUDA
        graphs: their memory is freed but for the outputs a caller still holds."""
        runs = list(self.graphs.values())
        self.graphs.clear()
        self._reusable.clear()
        self._constants_state.clear()
        self._constant_storages.clear()
        for run in runs:
            run.release()

    def unchanged_runs(self) -> list[CompiledRun]:
        """Its runs whose constants still have the memory and versions they had when compiled
        (the others' plans may hold what was computed from other values, folded batch norms or
        merged weights: a call compiles them again)."""
        return [run for key, run in self.graphs.items()
                if _unchanged(list(run.constants.values()), self._constants_state[key])]

    def _run_in_pytorch(self, args, shared: list[tuple[int, int]]):
        """Run `self.gm` in PyTorch on `args`, where the inputs of each pair in `shared` may
        share memory and the first of it is changed in place: eager's values (or errors)."""
        pairs = "\n  ".join(f"{self._names[w]} (changed in place) and {self._names[k]}"
                            for w, k in shared)
        _warn_once("Kiln runs this call in PyTorch: inputs that the graph changes in place share "
                   f"memory with other inputs, which Kiln does not model:\n  {pairs}")
        return self.gm.forward(*args)

    def _compile(self, args) -> CompiledRun:
        """A new CompiledRun for the call `args`, compiled under the graph's settings (or served
        by the whole-graph cache, or by `saved`)."""
        settings = self.settings_now()
        with applied(settings):
            return self._compile_now(args, settings)

    def _compile_now(self, args, settings: Settings) -> CompiledRun:
        described = [_describe_arg(a) for a in args]
        self.constant_ids |= {id(args[k]) for k in self._constant_positions}
        sizes = input_sizes(self.gm, args)
        key = graph_cache.key(self.gm, args, sizes, self.constant, self._read_positions, settings)
        if self.saved is not None:
            inputs = ", ".join(described[k] for k in self._input_positions) or "none"
            return self._run(*self.saved.served(key, args, inputs), args)
        logger.info("compiling a graph of %d fx nodes for inputs %s", len(self.gm.graph.nodes),
                    ", ".join(described))
        values = size_values(sizes)
        cached = key is not None and graph_cache.used(settings)
        if values:
            reused = self._reused(args, sizes, values, key, settings)
            if reused is not None:
                if cached:      # for later processes, which trace no plan to reuse
                    graph_cache.store(reused.record, reused.constants)
                return reused
        if cached:
            with stage("graph cache"):
                record = graph_cache.lookup(key, args)
                if record is not None:
                    return self._run(record.plan.assemble(), record, args)
        folder = dump_folder()
        with recording() as record:
            traced, traced_values, graph, run = self._trace_and_build(args, sizes, key, folder, settings)
        if cached:
            graph_cache.store(run.record, run.constants)
        publish(compile_summary(self.gm, self.compile_id, described, self.left_to_pytorch, traced,
                                graph, record, folder), self.compile_id)
        if folder is not None:
            dump_compiled(folder, self.gm, graph)
        if settings.correctness_report:
            print(correctness_report(self.gm, list(args), traced_values, traced, graph))
        return run

    def _reuse_key(self, args, sizes) -> tuple:
        """What a call `args` of input `sizes` must share with the trace of a plan it reuses:
        its inputs but their symbolic sizes' values (`plan_reuse.fixed_part`) and the values
        the graph reads of its one-element inputs."""
        return (fixed_part(args, sizes, self._input_positions)
                + tuple(args[k].item() for k in self._read_positions))

    def _reused(self, args, sizes, values: dict[str, int], key, settings: Settings) -> CompiledRun | None:
        """The CompiledRun of a plan traced at other sizes bound to the call `args` of input
        `sizes`, whose size variables are at `values` (`plan_reuse`), or None where none was
        traced with these constants and inputs or holds there."""
        for reusable in self._kept_for(args, sizes):
            with stage("reuse"):
                record = reusable.for_call(values, settings, key)
                if record is not None:
                    logger.info("a plan traced at other sizes serves sizes %s", values)
                    return self._run(record.plan.assemble(), record, args)
        return None

    def _kept_for(self, args, sizes) -> list[ReusablePlan]:
        """The kept plans traced with the constants and inputs of the call `args` of input
        `sizes` but their symbolic sizes' values (`_reuse_key`), the newest first."""
        constants = [args[k] for k in self._constant_positions]
        fixed = self._reuse_key(args, sizes)
        return [reusable for reusable, same, state in reversed(self._reusable)
                if same == fixed and _unchanged(constants, state)]

    def _trace_and_build(self, args, sizes, key, folder, settings: Settings):
        """The traced FlowGraph, the fx nodes' values in it, the optimized FlowGraph and its
        CompiledRun, for the call `args` of input `sizes` under `settings` (the compile's
        whole-graph `key` kept in its record); each pass's graph written to `folder`. Where
        sizes are symbolic, a plan that other sizes may reuse is kept (`plan_reuse`)."""
        recorded = bool(size_values(sizes)) and self._records_sizes
        with size_reads.recording() if recorded else contextlib.nullcontext() as reads:
            traced, traced_values, graph, compiled, record = self._trace(args, sizes, key, folder, settings)
        if recorded:
            reusable = ReusablePlan.of(record, reads, settings)
            if reusable is None:
                # a later size would most likely read the same: its trace records nothing
                self._records_sizes = False
                logger.info("the plan of sizes %s serves no other sizes: %s", size_values(sizes),
                            reads.read or "it holds constants of symbolic shapes")
            else:
                self._keep(reusable, args, sizes)
                if settings.plan_ahead == "always" or (settings.plan_ahead == "auto" and any(
                        isinstance(a, torch.Tensor) and a.is_cuda for a in args)):
                    self._plan_ahead(args, sizes, reusable, settings)
        return traced, traced_values, graph, self._run(compiled, record, args, graph)

    def _keep(self, reusable: ReusablePlan, args, sizes) -> None:
        """Keep `reusable`, traced for the call `args` of input `sizes`, for later sizes."""
        constants = [args[k] for k in self._constant_positions]
        self._reusable = [*self._reusable[1 - SIGNATURES_KEPT:],
                          (reusable, self._reuse_key(args, sizes), _constants_state(constants))]

    def _plan_ahead(self, args, sizes, reusable: ReusablePlan, settings: Settings) -> None:
        """Trace the graph at the sizes next to those that `reusable` (traced for the call
        `args` of input `sizes`) serves, where no kept plan serves them
        (`plan_reuse.neighbours`), and keep the plans that serve other sizes: a call there
        later binds one, its kernels already built. A plan that serves its own sizes alone
        (`ReusablePlan.serves_one_size`) is traced again with them compiled in."""
        for values in neighbours(reusable, size_values(sizes), size_ranges(self.gm)):
            if any(kept.serves(values, settings) for kept in self._kept_for(args, sizes)):
                continue
            ahead_sizes = sizes_at(sizes, values)
            with stage("plan ahead", str(values)), size_reads.recording() as reads:
                try:
                    record = self._trace(args, ahead_sizes, None, None, settings)[-1]
                except Exception as error:     # a size no call asked for: a call there traces again
                    logger.info("planning ahead at sizes %s failed: %s", values, error)
                    continue
            ahead = ReusablePlan.of(record, reads, settings)
            if ahead is not None and ahead.serves_one_size(values):
                logger.info("planning ahead at sizes %s: a plan for those alone, traced with them compiled in", values)
                with stage("plan ahead", f"{values} compiled in"):
                    record = self._trace(args, sizes_fixed_at(sizes, values), None, None, settings)[-1]
                ahead = ReusablePlan.at_one_size(record, values, settings)
            if ahead is not None:
                self._keep(ahead, args, ahead_sizes)

    def _trace(self, args, sizes, key, folder, settings: Settings):
        """`_trace_and_build`'s work: the traced FlowGraph, the fx nodes' values, the optimized
        FlowGraph, the CompiledGraph and the RunRecord."""
        values, inputs, positions = [], [], []
        # a CPU scalar input of a graph on a GPU is read there, as PyTorch combines them, and
        # so is a CPU tensor that only indexes others, as PyTorch's indexing copies it there
        gpu = next((a.device for a in args if isinstance(a, torch.Tensor) and a.is_cuda), None)
        moves: dict[int, str] = {}
        for k, (a, constant, size) in enumerate(zip(args, self.constant, sizes)):
            if isinstance(a, torch.Tensor) and a.is_complex():
                raise MappingError(self._complex_input(k, a))
            if isinstance(a, torch.Tensor):
                if constant:
                    v = from_torch(a)
                else:
                    if (gpu is not None and not a.is_cuda and (a.dim() == 0 or k in self._index_positions)
                            and k not in self._written_positions):
                        moves[len(positions)] = str(gpu)
                    v = symbol(size, a.dtype, moves.get(len(positions), a.device))
                    inputs.append(v)
                    positions.append(k)
            else:
                v = size
            values.append(v)
        interpreter = Interpreter(self.gm)
        traced_values = {}
        with recording_reads() as reads:
            with stage("interpret"):
                result = interpreter.run(values, on_node=traced_values.__setitem__)
                leaves = []
                map_aggregate(result, lambda v: leaves.append(v) if isinstance(v, Tensor) else v)
                writeback = list(interpreter.mutated_inputs)
                traced = trace_from(leaves + list(interpreter.mutated_inputs.values()), inputs)
            with stage("optimize", f"{len(traced.nodes)} operators"):
                # the outputs written back, by the position of their input among the graph's
                first = len(traced.outputs) - len(writeback)
                written = {first + k: positions.index(p) for k, p in enumerate(writeback)}
                graph = _optimize(traced, folder, written)
        with stage("build", f"{len(graph.nodes)} kernels"):
            compiled = graph.compile(settings)
        structure = map_aggregate(result, lambda v: Output() if isinstance(v, Tensor) else _plain(v))
        record = RunRecord(compiled.plan, positions, structure, writeback, moves,
                           _leaves_from(result, self.lent_from), tuple(sorted(permissions(traced))), key,
                           self._values_read(compiled.plan, args, reads))
        return traced, traced_values, graph, compiled, record

    def _values_read(self, plan, args, reads: set[int]) -> list[int]:
        """The positions of the constants whose values a compile of `args` read (`reads`: see
        `kiln.tensor.recording_reads`) or that a constant of its `plan` computed from them holds
        (one that no fold plan computes again: `graph_cache.folded`)."""
        constants = {k: args[k] for k in self._constant_positions}
        _, held = graph_cache.folded(plan, constants)
        return sorted({k for k, t in constants.items() if id(t) in reads} | set(held))

    def _complex_input(self, k: int, arg: torch.Tensor) -> str:
        """Why the complex input at position `k` cannot be compiled, naming the nodes reading it."""
        node = list(self.gm.graph.find_nodes(op="placeholder"))[k]
        readers = ", ".join(user.format_node() for user in node.users) or "no node"
        return unsupported_complex(f"the graph input {node.name} (read by {readers})",
                                   _describe_arg(arg))

    def _run(self, compiled: CompiledGraph, record: RunRecord, args,
             graph: FlowGraph | None = None) -> CompiledRun:
        """The CompiledRun of `compiled` (from `graph` where it was traced here), replayed as a
        CUDA graph where the settings say so and its inputs are on CUDA."""
        return compiled_run(compiled, record, args, self.settings.use_cuda_graph, graph, self.static_inputs,
                            self._constant_positions,
                            consumes_saved=self.lent_from == 0 and self.settings.reuse_saved_memory)


def compiled_run(compiled: CompiledGraph, record: RunRecord, args, use_cuda_graph: bool,
                 graph: FlowGraph | None = None, static_inputs=frozenset(),
                 constant_positions=(), consumes_saved: bool = False) -> CompiledRun:
    """The CompiledRun of `compiled` for calls like `args` (the graph's arguments, of which those
    at `constant_positions` are its constants), captured as a CUDA graph on them where
    `use_cuda_graph` and its inputs are on CUDA; `consumes_saved`: see CompiledRun."""
    examples = [args[p].to(record.moves[j]) if j in record.moves else args[p]
                for j, p in enumerate(record.positions)]
    on_cuda = bool(examples) and all(t.is_cuda for t in examples)
    return CompiledRun(compiled, record, examples if use_cuda_graph and on_cuda else None, graph, static_inputs,
                       {k: args[k] for k in constant_positions}, consumes_saved)


class CompiledRun:
    """A traced FlowGraph (replayed as a CUDA graph when given CUDA example inputs), how to put
    its outputs back into the graph's output structure, and the inputs its last outputs are
    written back to (inputs the graph changes in place).

    An input whose new value only replaces some of its elements (a KV cache written at the
    decoding position) is updated in place by the graph itself (`kiln.passes.in_place`): its
    written-back output is the input's own tensor, and nothing is copied back. On CUDA, a graph
    that changes contiguous inputs in place is captured on the caller's tensors, with the
    write-back (where one remains) inside the graph: a call is one replay, with no copy of those
    inputs in; an output that is an input written back is copied before the write-back. The outputs at positions `lent` (a training forward's values
    saved for the backward) are lent, not copied, and a graph called with lent tensors or with
    tensors another capture reads in place (the backward, on saved values and parameters) is
    captured reading them in place (`kiln.runtime.cuda_graph.stays_put`), as it reads the
    contiguous arguments at positions `static_inputs` (a training forward's parameters). New memory for
    bound inputs, or every capture busy with lent outputs still alive, captures again. Captures
    that are busy, or read another graph's lent values (each serves its lender's values at every
    step, and goes once orphaned), are kept: a block's graph called once for each layer of a
    model before the backward has a forward capture for each, and its backward a capture reading
    each one's values. Of the others, the last used are kept, CAPTURES_KEPT of them. Beyond
    CAPTURES_MAX captures in all, and for inputs that cannot be captured so, calls run without
    a CUDA graph. An input that came at new memory MOVES_BEFORE_COPY times
    (FSDP's parameters, gathered into new memory at every step) is copied in by the captures
    made after that, which then replay, instead of one capture a call. The inputs at positions
    `moves` (CPU scalars of a graph on a GPU) are copied to their device first.

    A training forward's captures lend its other outputs too (a language model's logits, which
    the loss graph then reads in place), until a call finds such a capture busy (a caller keeping
    the outputs of one step into the next): from then on its captures copy them out, and those
    that lent them are retired (`CapturedGraph.retire`: their memory is freed but for what the
    callers hold) before the next capture allocates a second set of saved values.

    With `consumes_saved` (a training backward, the `reuse_saved_memory` setting), a capture
    made while autograd keeps no graph puts gradients and intermediates in the memory of the
    forward's saved values after reading them (`kiln.runtime.cuda_graph.capture`).

    Where no output is at `lent` (inference: a training graph's captures would each hold its
    saved values), the first LENDING_CAPTURES captures lend the caller every output the graph
    allocates: a call hands out the CUDA graph's own output memory, with no copy, and
    the next call replays another capture while the caller still holds those outputs (the usual
    `out = model(x)` loop alternates between two captures). Captures made while those are busy
    copy their outputs out, so that a caller keeping every call's outputs (a list of
    predictions) holds copies, not a capture each. The first call makes the lending captures
    and one copying capture at once: a capture while another thread draws CUDA random numbers
    fails in torch (the capture puts torch's CUDA generator in capture mode for every thread),
    so calls from several threads find a capture to replay instead of capturing. `constants` holds
    the graph's constant arguments it was compiled for, by position (the parameters and buffers
    that `graph_cache.entry` tells from tensors computed while compiling, for `kiln.save`; see
    also `KilnFunction.unchanged_runs`)."""

    CAPTURES_KEPT = 4
    CAPTURES_MAX = 64
    MOVES_BEFORE_COPY = 2
    LENDING_CAPTURES = 2

    def __init__(self, compiled: CompiledGraph, record: RunRecord, cuda_examples=None,
                 graph: FlowGraph | None = None, static_inputs=frozenset(), constants: dict | None = None,
                 consumes_saved: bool = False):
        self.compiled = compiled
        self.consumes_saved = consumes_saved
        self.graph = graph
        self.record = record
        self.constants = constants or {}
        self.positions = record.positions
        self.structure = record.structure
        self.writeback = record.writeback
        self.moves = {j: torch.device(d) for j, d in record.moves.items()}
        self.lent = list(record.lent)
        # every returned output (those written back to inputs are not returned)
        self.returned = list(range(len(compiled.outputs) - len(self.writeback)))
        self.static = {j for j, p in enumerate(self.positions) if p in static_inputs}
        self.relocations = Counter()    # input position -> calls that found it at new memory
        # a tuple or list of tensors (dynamo's usual output) is rebuilt without map_aggregate
        self.flat_tensors = (type(self.structure) in (tuple, list) and not self.writeback and
                             all(isinstance(v, Output) for v in self.structure))
        # outputs in memory the graph holds from call to call (a value known when compiling,
        # zeros or a range, or a view of one) are copied at each call, as eager makes them anew:
        # a caller writing into one would change later calls' results (the caller's own
        # constants, parameters, are handed out as they are, as eager does)
        theirs = {t.untyped_storage().data_ptr() for t in self.constants.values()}
        self.held_outputs = [k for k, slot in enumerate(compiled.outputs) if _held(compiled, slot, theirs)]
        # a training forward lends its user outputs too, until a call finds them alive (class doc)
        self.saves_for_backward = bool(self.lent) and len(self.lent) < len(self.returned)
        self.lends_user_outputs = self.saves_for_backward
        self._lending: weakref.WeakSet = weakref.WeakSet()    # captures lending outputs beyond `lent`
        self.captures: OrderedDict | None = None
        # a graph whose steps all have no elements launches nothing: no CUDA graph to capture
        if cuda_examples is not None and any(compiled.buffers[s].nbytes
                                             for step in compiled.steps for s in step.outputs):
            first = len(compiled.outputs) - len(self.writeback)
            inputs = {p: j for j, p in enumerate(self.positions)}
            self.write_back = [(first + k, inputs[p]) for k, p in enumerate(self.writeback)]
            self.written = {j for _, j in self.write_back}     # always bound: captured in place
            self.captures = OrderedDict()
            self._captures_lock = threading.Lock()
            # the shared workspace of the last capture, kept past that capture: a consuming
            # backward that superseded its forward's workspace retires after its one replay, and
            # the next forward must capture on this larger one, not on a new small one that the
            # backward would supersede again at every step
            self.workspace = None
            # the copying capture first: its workspace, which holds its outputs too, serves the
            # lending ones (a larger one made after would leave it stale)
            for lend in [self.lends_user_outputs] if self.lent else [False] + [True] * self.LENDING_CAPTURES:
                if self._capture(cuda_examples, lend) is None:
                    break

    def _capture(self, inputs: list[torch.Tensor], lend: bool | None = None):
        """A capture for `inputs`' memory (None when an input written back is not contiguous:
        such calls run without a CUDA graph), lending its outputs where `lend` says, or by
        default where fewer than LENDING_CAPTURES captures lend."""
        if not all(inputs[j].is_contiguous() for j in self.written):
            return None
        bound = [j for j, t in enumerate(inputs) if j not in self.written and t.is_contiguous()
                 and (j in self.static or stays_put(t)) and self.relocations[j] < self.MOVES_BEFORE_COPY]
        if lend is None:
            with self._captures_lock:
                lend = (self.lends_user_outputs if self.lent else
                        sum(map(self._lends_results, self.captures.values())) < self.LENDING_CAPTURES)
        # a training forward's saved values are private: the backward takes their memory once
        # it read them (`kiln.runtime.cuda_graph.capture`), where autograd is done with them
        consumes = self.consumes_saved and not keeps_graph()
        captured = capture(self.compiled, inputs, write_back=self.write_back,
                           lent=self.returned if lend else self.lent, bound=bound, copied_out=True,
                           private=self.lent if self.saves_for_backward else (), reused=bound if consumes else ())
        self.workspace = captured.workspace
        if set(captured.lent) - set(self.lent):
            self._lending.add(captured)
        with self._captures_lock:
            idle = [key for key, c in self.captures.items() if not c.busy()]
            spare = [key for key in idle if not self.captures[key].borrowed]
            kept = sum(not c.borrowed for c in self.captures.values()) + 1
            for key in spare[:max(0, kept - self.CAPTURES_KEPT)]:
                del self.captures[key]
            idle = [key for key in idle if key in self.captures]
            for key in idle[:max(0, len(self.captures) + 1 - self.CAPTURES_MAX)]:
                del self.captures[key]
            self.captures[id(captured)] = captured
        return captured

    def _lends_results(self, captured) -> bool:
        """Whether `captured` lends outputs beyond `lent` (an inference graph's LENDING_CAPTURES,
        a training forward's captures lending its user outputs)."""
        return captured in self._lending

    def _replay(self, inputs: list[torch.Tensor]) -> list | None:
        """The outputs of a replay for `inputs` (a capture reading inputs in place first),
        captured now if none binds them or all are busy; None where they cannot be captured
        or CAPTURES_MAX captures are busy. Captures on a superseded shared workspace, and,
        before capturing anew, captures bound to lent values that no graph lends any more, are
        dropped where not busy (`kiln.runtime.cuda_graph`)."""
        # no local variable may hold a capture past the drops below: a dropped capture's memory
        # (its lent outputs, a superseded workspace) must be free before a new capture allocates
        binding = next((c.binding for c in reversed(self.captures.values())), None)
        self._drop(lambda c: c.stale())
        outs = self._replay_captured(inputs)
        if outs is not None:
            return outs
        moved = moved_inputs(binding, inputs) if binding is not None else []
        # another graph's lent values move when it is captured again, and an input written back
        # is always bound: neither is counted
        self.relocations.update(j for j in moved
                                if j not in self.written and (j in self.static or not stays_put(inputs[j])))
        moving = {j for j, n in self.relocations.items() if n >= self.MOVES_BEFORE_COPY}
        if self.lends_user_outputs and any(self._lends_results(c) and c.busy() for c in list(self.captures.values())):
            # what the lending captures hold but their callers' aliases is freed before the new
            # capture allocates its own
            self.lends_user_outputs = False
            for captured in list(self._lending):
                captured.retire()
            self._drop(lambda c: c.retired)
            logger.info("a training forward's lent outputs are still alive at its next call: its captures "
                        "copy its outputs out from now on")
        self._drop(lambda c: c.orphaned() or not moving.isdisjoint(c.bound))
        if len(self.captures) >= self.CAPTURES_MAX and all(c.busy() for c in list(self.captures.values())):
            logger.info("a call runs without a CUDA graph: the values its %d captures lent are still alive",
                        len(self.captures))
            return None
        logger.info("capturing a CUDA graph again: %s", f"inputs {moved} at new memory (copied in from now on: "
                    f"{sorted(moving)})" if moved else "the captures are busy or stale")
        captured = self._capture(inputs)
        return None if captured is None else captured.run(inputs, copy=True)

    def _replay_captured(self, inputs: list[torch.Tensor]) -> list | None:
        """The outputs of the first capture that replays for `inputs` (those reading inputs in
        place first, then lending ones); None where none does."""
        captures = sorted(reversed(self.captures.items()), key=lambda kc: (not kc[1].bound,
                                                                           not self._lends_results(kc[1])))
        for key, captured in captures:
            outs = captured.run(inputs, copy=True)
            if outs is not None:
                if len(self.captures) > 1:
                    with self._captures_lock:
                        if key in self.captures:
                            self.captures.move_to_end(key)
                return outs
        return None

    def release(self) -> None:
        """Retire every capture (`CapturedGraph.retire`) and forget them and the kept workspace."""
        if self.captures is None:
            return
        with self._captures_lock:
            captures = list(self.captures.values())
            self.captures.clear()
            self.workspace = None
        for captured in captures:
            captured.retire()

    def _drop(self, useless) -> None:
        """Forget the captures that are `useless` and not busy."""
        with self._captures_lock:
            for key, captured in list(self.captures.items()):
                if useless(captured) and not captured.busy():
                    del self.captures[key]

    def __call__(self, args):
        inputs = [args[p] for p in self.positions]
        for j, device in self.moves.items():
            inputs[j] = inputs[j].to(device, non_blocking=True)
        outs = self._replay(inputs) if self.captures is not None else None
        if outs is None:
            outs = self.compiled.run(inputs)
            for k in self.held_outputs:
                outs[k] = outs[k].clone()
            if self.writeback:
                changed, outs = outs[-len(self.writeback):], outs[:-len(self.writeback)]
                # an output that is an input written back (`old = x.clone()` before `x.add_(1)`,
                # which Kiln computes as x itself) keeps the value from before the write-back
                # (one updated in place, `kiln.passes.in_place`, is its final value: no copy back)
                copied = [args[p] for p, value in zip(self.writeback, changed) if value is not args[p]]
                outs = [o.clone() if any(o is w for w in copied) else o for o in outs]
                for position, value in zip(self.writeback, changed):
                    if value is not args[position]:     # an input updated in place is the value
                        args[position].copy_(value)
        if self.flat_tensors:
            return type(self.structure)(outs)
        outs = iter(outs)
        return map_aggregate(self.structure, lambda v: next(outs) if isinstance(v, Output) else v)


def _held(compiled: CompiledGraph, slot: int, theirs: set[int]) -> bool:
    """Whether output `slot` of `compiled` is (a view of) a constant the graph holds itself: one
    whose memory is none of the caller's constants' (`theirs`, their storages' addresses)."""
    while slot in compiled.views:
        slot = compiled.views[slot]
    held = compiled.constants.get(slot)
    return held is not None and held.untyped_storage().data_ptr() not in theirs


def _leaves_from(structure, first: int | None) -> list[int]:
    """The positions among `structure`'s tensors (a graph's outputs, flattened) of those at
    position `first` or later of a tuple or list `structure`; none without `first`."""
    if first is None or type(structure) not in (tuple, list):
        return []
    tensors = [k for k, v in enumerate(structure) if isinstance(v, Tensor)]
    return [j for j, k in enumerate(tensors) if k >= first]


def _constants_state(constants: list[torch.Tensor]) -> tuple[list, list]:
    """What `_unchanged` compares: the constants' memory addresses and versions."""
    return [t.data_ptr() for t in constants], [t._version for t in constants]


def _unchanged(constants: list[torch.Tensor], state: tuple[list, list]) -> bool:
    """Whether `constants` still have the memory and versions `state` recorded."""
    addresses, versions = state
    return same_addresses(constants, addresses) and [t._version for t in constants] == versions


def _plain(value):
    """A graph's non-tensor output as the caller gets it: a symbolic size as its int."""
    return int(value) if isinstance(value, SymSize) else value


def _changed_in_place(gm: GraphModule) -> set:
    """The placeholders that nodes of `gm` change in place, directly or through the result of
    an earlier in-place call (`x.add_(1).mul_(2)`)."""
    changed, root = set(), {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            root[node] = node
        elif mutates(node) and node.args and node.args[0] in root:
            changed.add(root[node.args[0]])
            root[node] = root[node.args[0]]
    return changed


def _may_vary(placeholder) -> bool:
    """Whether calls may pass `placeholder` other shapes, dtypes or devices than its trace: it
    is not a tensor of fixed sizes (one whose sizes are symbolic, or one without a traced value,
    as in a graph dynamo did not make)."""
    value = placeholder.meta.get("val", placeholder.meta.get("example_value"))
    return not isinstance(value, torch.Tensor) or any(isinstance(d, torch.SymInt) for d in value.shape)


def _signature(arg):
    if isinstance(arg, torch.Tensor):
        return (tuple(arg.shape), arg.dtype, arg.device)
    try:
        hash(arg)
        return arg
    except TypeError:
        return repr(arg)


def _describe_arg(arg) -> str:
    if isinstance(arg, torch.Tensor):
        return f"{str(arg.dtype).replace('torch.', '')}{list(arg.shape)}"
    return repr(arg)


def _optimize(graph: FlowGraph, folder=None, written: dict[int, int] | None = None) -> FlowGraph:
    """The graph after Kiln's graph passes under the caller's PassContext (opt level, passes,
    instruments) and the settings in effect (the compile's); each stage written to `folder`. The
    outputs `written` (output position -> input position) are written back into inputs:
    those that update their input's elements are computed in place (`kiln.passes.in_place`).
    Then, on a GPU, independent tiny element-wise kernels are merged (`kiln.passes.horizontal`);
    last, the kernels computing the updates' rows store them themselves (`kiln.passes.row_stores`)."""
    instruments = [*PassContext.current().instruments, *([DumpGraph(str(folder / "passes"))] if folder else [])]
    with PassContext(instruments=instruments):
        graph = optimize(graph)
        # an in-place update is placed by the order it is decided on: such graphs keep theirs
        graph = UpdateInPlace(written)(graph) if written else in_memory_order(graph)
        # a launch costs microseconds on a GPU, where a CPU kernel is a call
        if target_of(graph).is_cuda:
            graph = MergeIndependentKernels()(graph)
        return StoreRowsInKernels()(graph) if written else graph
