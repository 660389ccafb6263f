"""The torch.compile backend "kiln" (registered through the `torch_dynamo_backends` entry point).

`kiln_backend(gm, example_inputs, options=None)` checks that every operator of the graph is
mapped (raising one `UnmappedOperatorError` listing all that are not, or, with
`dynamo_config.fallback_to_eager(True)`, leaving them to PyTorch), and returns a `KilnFunction`.
That traces a FlowGraph when it first sees an input signature, reading the settings then
(search_space as the tuning level of the kernels built by that first run; use_cuda_graph to
replay CUDA graphs), and runs it from then on. Parameters and buffers become constants of the
FlowGraph, sharing memory.
"""
from __future__ import annotations

import contextlib
import os
import warnings

import torch
from torch.fx import GraphModule
from torch.fx.node import map_aggregate
from torch.fx.passes.split_module import split_module

from kiln.frontend.torch.config import Settings, dynamo_config
from kiln.frontend.torch.errors import UnmappedOperatorError
from kiln.frontend.torch.interpreter import Interpreter
from kiln.frontend.torch.report import correctness_report, input_graph_table
from kiln.graph import FlowGraph, optimize, trace_from
from kiln.passes import PassContext
from kiln.tensor import Tensor, from_torch, symbol

_warned: set[tuple] = set()


def kiln_backend(gm: GraphModule, example_inputs, options: dict | None = None, **_):
    """Compile a dynamo graph with Kiln; `options` may carry torch.compile's mode or settings."""
    settings = dynamo_config.resolve(options)
    if settings.print_input_graph:
        print(input_graph_table(gm))
    constants = constant_placeholders(gm, example_inputs)
    unmapped = Interpreter(gm).unmapped()
    if not unmapped:
        return KilnFunction(gm, settings, constants)
    if not settings.fallback_to_eager:
        raise UnmappedOperatorError(unmapped)
    key = tuple(o.name for o in unmapped)
    if key not in _warned:
        _warned.add(key)
        warnings.warn(f"Kiln runs these unmapped operators in PyTorch: {', '.join(key)}",
                      stacklevel=2)
    return _split(gm, settings, constants)


def constant_placeholders(gm: GraphModule, example_inputs) -> set[str]:
    """Names of the placeholders that hold parameters or buffers (constants of the graph)."""
    names = set()
    for node, example in zip((n for n in gm.graph.nodes if n.op == "placeholder"), example_inputs):
        grapharg = node.meta.get("grapharg")
        source = getattr(getattr(grapharg, "source", None), "name", "")
        if isinstance(example, torch.nn.Parameter) or "._buffers[" in str(source):
            names.add(node.name)
    return names


def _split(gm: GraphModule, settings: Settings, constants: set[str]) -> GraphModule:
    """Partition the graph into runs of mapped nodes (compiled) and unmapped ones (eager)."""
    interpreter = Interpreter(gm)
    partition, mapped, current, previous = {}, {}, 0, None
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        ok = interpreter.is_mapped(node)
        if ok != previous or not ok:  # each unmapped node runs alone
            current += 1
        partition[node], mapped[current], previous = current, ok, ok
    split = split_module(gm, None, partition.__getitem__, keep_original_order=True)
    for pid, ok in mapped.items():
        name = f"submod_{pid}"
        if ok and hasattr(split, name):
            compiled = KilnFunction(getattr(split, name), settings, constants)
            delattr(split, name)
            setattr(split, name, compiled)
    return split


class KilnFunction:
    """One dynamo graph compiled by Kiln: a FlowGraph per input signature, traced on first use."""

    def __init__(self, gm: GraphModule, settings: Settings, constants: set[str] = frozenset()):
        self.gm = gm
        self.settings = settings
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.constant = [n.name in constants for n in placeholders]
        self.graphs: dict[tuple, _Compiled] = {}

    def __call__(self, *args):
        key = tuple(_signature(a, c) for a, c in zip(args, self.constant))
        compiled = self.graphs.get(key)
        if compiled is None:  # kernels are built (and tuned) by this first run
            with _tuning_level(self.settings.search_space):
                compiled = self.graphs[key] = self._compile(args)
                return compiled(args)
        return compiled(args)

    def _compile(self, args) -> _Compiled:
        if self.settings.correctness_report:
            print(correctness_report(self.gm, list(args)))
        values, inputs, positions = [], [], []
        for k, (a, constant) in enumerate(zip(args, self.constant)):
            if isinstance(a, torch.Tensor):
                if constant:
                    v = from_torch(a)
                else:
                    v = symbol(a.shape, a.dtype, a.device)
                    inputs.append(v)
                    positions.append(k)
            else:
                v = a
            values.append(v)
        interpreter = Interpreter(self.gm)
        result = interpreter.run(values)
        leaves = []
        map_aggregate(result, lambda v: leaves.append(v) if isinstance(v, Tensor) else v)
        writeback = list(interpreter.mutated_inputs)
        graph = _optimize(trace_from(leaves + list(interpreter.mutated_inputs.values()), inputs),
                          self.settings)
        examples = [args[p] for p in positions]
        on_cuda = bool(examples) and all(t.is_cuda for t in examples)
        return _Compiled(graph, positions, result, writeback,
                         examples if self.settings.use_cuda_graph and on_cuda else None)


class _Compiled:
    """A traced FlowGraph (replayed as a CUDA graph when given CUDA example inputs), how to put
    its outputs back into the graph's output structure, and the inputs its last outputs are
    written back to (inputs the graph changes in place)."""

    def __init__(self, graph: FlowGraph, positions: list[int], structure, writeback: list[int],
                 cuda_examples=None):
        self.graph = graph
        self.positions = positions
        self.structure = structure
        self.writeback = writeback
        graph.compile()  # builds every kernel in parallel, under the caller's tuning level
        self.run = graph.run
        if cuda_examples is not None:
            captured = graph.cuda_graph(cuda_examples)
            # replays overwrite the captured outputs: the caller gets copies
            self.run = lambda inputs: captured.run(inputs, copy=True)

    def __call__(self, args):
        outs = self.run([args[p] for p in self.positions])
        if self.writeback:
            changed, outs = outs[-len(self.writeback):], outs[:-len(self.writeback)]
            for position, value in zip(self.writeback, changed):
                args[position].copy_(value.torch())
        outs = iter(outs)
        return map_aggregate(self.structure,
                             lambda v: next(outs).torch() if isinstance(v, Tensor) else v)


def _signature(arg, constant: bool):
    if isinstance(arg, torch.Tensor):
        identity = (id(arg), arg.data_ptr()) if constant else ()
        return (tuple(arg.shape), arg.dtype, arg.device) + identity
    try:
        hash(arg)
        return arg
    except TypeError:
        return repr(arg)


@contextlib.contextmanager
def _tuning_level(level: int):
    """Build kernels at schedule-search `level` ($KILN_TUNE_LEVEL, which the tuner reads)."""
    if not level:
        yield
        return
    previous = os.environ.get("KILN_TUNE_LEVEL")
    os.environ["KILN_TUNE_LEVEL"] = str(level)
    try:
        yield
    finally:
        if previous is None:
            del os.environ["KILN_TUNE_LEVEL"]
        else:
            os.environ["KILN_TUNE_LEVEL"] = previous


def _optimize(graph: FlowGraph, settings: Settings) -> FlowGraph:
    """The graph after Kiln's graph passes under the caller's PassContext (opt level, passes,
    instruments), with dynamo_config's float16 settings."""
    outer = PassContext.current()
    config = {**outer.config, "use_fp16": settings.use_fp16,
              "use_fp16_reduction": settings.use_fp16_reduction}
    with PassContext(outer.opt_level, outer.required_passes, outer.disabled_passes, config,
                     outer.instruments):
        return optimize(graph)
