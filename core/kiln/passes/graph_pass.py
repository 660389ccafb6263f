"""Graph passes: a name, an opt level and a transformation of a FlowGraph.

Subclass `GraphPass` and implement `transform`, or decorate a function with `graph_pass`;
compose passes with `Sequential`, as TVM's tutorial composes its pipelines:

    @graph_pass("drop_dropout", opt_level=1)
    def drop_dropout(graph, ctx):
        return rebuild(graph, lambda node, inputs:
                       inputs[:1] if node.definition.name == "dropout" else None)

    pipeline = Sequential([drop_dropout, FoldConstants(), FuseOperators()])
    with PassContext(opt_level=2):
        graph = pipeline(graph)

(`rebuild` is `kiln.passes.edit.rebuild`; `FoldConstants` and `FuseOperators` are in
`kiln.passes`.) A plugin's pass declares the stage of the default pipeline it runs in
(`stage`, one of `STAGES`).
"""
from __future__ import annotations

from typing import Callable, Sequence

from kiln.device import Device, device
from kiln.graph import FlowGraph, tracing
from kiln.passes.context import PassContext
from kiln.schedule.session import CompileSession

STAGES = ("simplify", "precision", "layout")
"""The stages of the default pipeline at whose end the plugins' passes run, in order (within a
stage, in the order the plugins contribute them):

- "simplify": after dead-code and common-subexpression elimination and the subgraph rewrites,
  before constant folding (the default);
- "precision": after constant folding, float16 conversion and the TF32 permission: the graph
  holds the types it runs in;
- "layout": after layout planning (channels-last regions), before recomputation and fusion.
"""


def target_of(graph: FlowGraph) -> Device:
    """The device `graph` runs on: its first input's or output's (the CPU for a graph of
    neither)."""
    return next((t.device for t in (*graph.inputs, *graph.outputs)), device("cpu"))


class GraphPass:
    """A transformation of a FlowGraph; calling it runs it under the current PassContext
    (skipped where the context disables it, watched by the context's instruments), in
    `kiln.graph.tracing()`: large generated values stay nodes of the graphs it builds. It runs
    in the compile session open (`PassContext.session`), or in one of its own for `graph`'s
    device: a pipeline's passes share the pipeline's."""

    name: str = ""
    opt_level: int = 0
    stage: str = "simplify"
    """Where the default pipeline runs it, if a plugin contributes it (one of `STAGES`)."""

    def transform(self, graph: FlowGraph, ctx: PassContext) -> FlowGraph:
        """Return the transformed graph (never modify `graph` in place)."""
        raise NotImplementedError

    def __call__(self, graph: FlowGraph) -> FlowGraph:
        ctx = PassContext.current()
        if not ctx.pass_enabled(self):
            return graph
        for inst in ctx.instruments:
            inst.run_before_pass(graph, self)
        session = ctx.session or CompileSession(target_of(graph))
        with tracing(), session.opened():
            graph = self.transform(graph, ctx)
        for inst in ctx.instruments:
            inst.run_after_pass(graph, self)
        return graph

    def __repr__(self) -> str:
        return f"<graph pass {self.name} (opt level {self.opt_level})>"


class FunctionPass(GraphPass):
    """A pass made of a function `fn(graph, ctx) -> graph`."""

    def __init__(self, fn: Callable, name: str, opt_level: int, stage: str = "simplify"):
        self.fn, self.name, self.opt_level, self.stage = fn, name, opt_level, stage
        self.__doc__ = fn.__doc__

    def transform(self, graph, ctx):
        return self.fn(graph, ctx)


def graph_pass(name: str | None = None, opt_level: int = 0, stage: str = "simplify"):
    """Decorator making `fn(graph, ctx) -> graph` a GraphPass (of the pipeline stage `stage`,
    one of `STAGES`, where a plugin contributes it)."""
    def wrap(fn):
        return FunctionPass(fn, name or fn.__name__, opt_level, stage)
    return wrap


class Sequential(GraphPass):
    """Passes run one after the other; each is still enabled or not on its own."""

    def __init__(self, passes: Sequence[GraphPass], name: str = "sequential", opt_level: int = 0):
        self.passes = list(passes)
        self.name, self.opt_level = name, opt_level

    def transform(self, graph, ctx):
        for p in self.passes:
            graph = p(graph)
        return graph
