"""Operators and flow graphs: definitions, nodes, tracing, printing and execution.

`optimize(graph)` applies the optimization pipeline, which belongs to the pass manager, a layer
above graphs (`kiln.passes` imports `kiln.graph`, never the reverse): `kiln.passes` installs its
pipeline here with `use_pipeline` when it is imported, which `import kiln` always does.
"""
from __future__ import annotations

from typing import Callable

from kiln.graph.flow_graph import FlowGraph, format_graph, in_memory_order, known_value, known_value_at, trace_from
from kiln.graph.operator import (GENERATED_BYTES_HELD, Operator, OperatorDef, OperatorError, operator,
                                 run_task, tracing)
from kiln.graph.traits import TF32, Layout, Role, Traits, Update

__all__ = ["FlowGraph", "GENERATED_BYTES_HELD", "Layout", "Operator", "OperatorDef", "OperatorError", "Role",
           "TF32", "Traits", "Update", "format_graph", "in_memory_order", "known_value", "known_value_at", "operator", "optimize",
           "run_task", "trace_from", "tracing", "use_pipeline"]

_pipeline: Callable | None = None


def use_pipeline(run: Callable) -> None:
    """Make `run(graph) -> graph` the pipeline that `optimize` applies."""
    global _pipeline
    _pipeline = run


def optimize(graph):
    """`graph` (a FlowGraph) optimized by the default pass pipeline under the current
    `kiln.PassContext` (see `kiln.passes`); inputs, outputs and their order are kept."""
    if _pipeline is None:
        raise RuntimeError("no optimization pipeline is installed: import kiln (or kiln.passes) first")
    return _pipeline(graph)
