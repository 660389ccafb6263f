"""The default optimization pipeline and `optimize` (also `kiln.graph.optimize`)."""
from __future__ import annotations

from kiln.graph import FlowGraph, use_pipeline
from kiln.passes.cse import EliminateCommonSubexpressions
from kiln.passes.dce import EliminateDeadCode
from kiln.passes.fold_constants import FoldConstants
from kiln.passes.fp16 import ConvertToFloat16
from kiln.passes.fusion import FuseOperators
from kiln.passes.recompute import RecomputeCheapProducers
from kiln.passes.graph_pass import STAGES, GraphPass, Sequential
from kiln.passes.layout import PlanLayout
from kiln.passes.subgraph_rewrite import RewriteSubgraphs
from kiln.passes.tf32 import AllowTF32
from kiln.plugins import registry


class PassError(RuntimeError):
    """A plugin's graph pass raised, or returned something other than a FlowGraph."""


class PluginPass(GraphPass):
    """A plugin's graph pass, run so that its failures name it and its plugin."""

    def __init__(self, inner: GraphPass, distribution: str):
        self.inner, self.distribution = inner, distribution
        self.name, self.opt_level, self.stage = inner.name, inner.opt_level, inner.stage
        if self.stage not in STAGES:
            raise PassError(f"graph pass '{self.name}' of plugin {distribution} declares the stage "
                            f"{self.stage!r}; the pipeline's stages are {', '.join(STAGES)}")

    def transform(self, graph: FlowGraph, ctx) -> FlowGraph:
        where = f"graph pass '{self.name}' of plugin {self.distribution}"
        try:
            out = self.inner.transform(graph, ctx)
        except Exception as exc:
            raise PassError(f"{where} failed: {type(exc).__name__}: {exc}") from exc
        if not isinstance(out, FlowGraph):
            raise PassError(f"{where} returned {type(out).__name__} instead of a FlowGraph "
                            "(a pass returns the transformed graph, or the graph it was given)")
        return out


def default_pipeline(plugin_passes: list[PluginPass] | None = None) -> Sequential:
    """The passes `optimize` runs, in order: dead-code and common-subexpression elimination and
    the subgraph rewrites (batch-norm folding among them); constant folding, float16
    conversion and the TF32 permission of operators declaring the trait `tf32`; layout
    planning (which sees the types the graph runs in); the recomputation of cheap element-wise
    values in each of their readers, and fusion (which fuses the layout conversions into their
    neighbours). The plugins' passes (by default those the registry holds) run at the end of
    the stage each declares (`kiln.passes.graph_pass.STAGES`)."""
    if plugin_passes is None:
        plugin_passes = [PluginPass(c.item, c.plugin.distribution)
                         for c in registry().contributions["graph_passes"]]
    staged = {stage: [p for p in plugin_passes if p.stage == stage] for stage in STAGES}
    return Sequential([
        EliminateDeadCode(),
        EliminateCommonSubexpressions(),
        RewriteSubgraphs(),
        *staged["simplify"],
        FoldConstants(),
        EliminateCommonSubexpressions(),
        ConvertToFloat16(),
        AllowTF32(),
        *staged["precision"],
        PlanLayout(),
        *staged["layout"],
        RecomputeCheapProducers(),
        FuseOperators(),
        EliminateDeadCode(),
    ], name="optimize")


def optimize(graph: FlowGraph) -> FlowGraph:
    """`graph` optimized by the default pipeline under the current PassContext; inputs,
    outputs and their order are kept."""
    return default_pipeline()(graph)


use_pipeline(optimize)
