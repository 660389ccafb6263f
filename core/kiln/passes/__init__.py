"""The pass manager: PassContext, instruments, graph passes, rewrite patterns, fusion.

`optimize(graph)` (also `kiln.graph.optimize`) runs `default_pipeline()` under the current
`PassContext`.
"""
from kiln.passes.context import PassContext
from kiln.passes.cse import EliminateCommonSubexpressions
from kiln.passes.dce import EliminateDeadCode
from kiln.passes.fold_constants import FoldConstants
from kiln.passes.fp16 import ConvertToFloat16
from kiln.passes.fused import FusedOperator
from kiln.passes.fusion import FuseOperators
from kiln.passes.graph_pass import FunctionPass, GraphPass, Sequential, graph_pass
from kiln.passes.horizontal import MergeIndependentKernels
from kiln.passes.in_place import UpdateInPlace
from kiln.passes.instruments import DumpGraph, PassInstrument, PassTiming, PrintGraph
from kiln.passes.layout import PlanLayout
from kiln.passes.pattern import (
    Match, OpPattern, Pattern, RewritePattern, Wildcard, constant, op, rewrite_pattern, wildcard,
)
from kiln.passes.pipeline import default_pipeline, optimize
from kiln.passes.row_stores import StoreRowsInKernels
from kiln.passes.subgraph_rewrite import RewriteSubgraphs
from kiln.passes.tf32 import AllowTF32

__all__ = [
    "AllowTF32", "ConvertToFloat16", "DumpGraph", "EliminateCommonSubexpressions",
    "EliminateDeadCode", "FoldConstants", "FunctionPass", "FuseOperators", "FusedOperator",
    "GraphPass", "Match", "MergeIndependentKernels", "OpPattern", "PassContext", "PassInstrument",
    "PassTiming", "Pattern", "PlanLayout", "PrintGraph", "RewritePattern", "RewriteSubgraphs", "Sequential", "StoreRowsInKernels", "UpdateInPlace", "Wildcard", "constant",
    "default_pipeline", "graph_pass", "op", "optimize", "rewrite_pattern", "wildcard",
]
