"""The default optimization pipeline and `optimize` (also `kiln.graph.optimize`)."""
from __future__ import annotations

from kiln.graph import FlowGraph, use_pipeline
from kiln.passes.cse import EliminateCommonSubexpressions
from kiln.passes.dce import EliminateDeadCode
from kiln.passes.fold_constants import FoldConstants
from kiln.passes.fp16 import ConvertToFloat16
from kiln.passes.fusion import FuseOperators
from kiln.passes.graph_pass import GraphPass, Sequential
from kiln.passes.subgraph_rewrite import RewriteSubgraphs
from kiln.plugins import registry


def default_pipeline(plugin_passes: list[GraphPass] | None = None) -> Sequential:
    """The passes `optimize` runs, in order; the plugins' passes run after the subgraph
    rewrites and before float16 conversion and fusion."""
    if plugin_passes is None:
        plugin_passes = registry().items("graph_passes")
    return Sequential([
        EliminateDeadCode(),
        EliminateCommonSubexpressions(),
        RewriteSubgraphs(),
        *plugin_passes,
        FoldConstants(),
        EliminateCommonSubexpressions(),
        ConvertToFloat16(),
        FuseOperators(),
        EliminateDeadCode(),
    ], name="optimize")


def optimize(graph: FlowGraph) -> FlowGraph:
    """`graph` optimized by the default pipeline under the current PassContext; inputs,
    outputs and their order are kept."""
    return default_pipeline()(graph)


use_pipeline(optimize)
