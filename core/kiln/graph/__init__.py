"""Operators and flow graphs: definitions, nodes, tracing, printing and execution."""
from kiln.graph.flow_graph import FlowGraph, format_graph, trace_from
from kiln.graph.operator import Operator, OperatorDef, OperatorError, operator, run_task

__all__ = ["FlowGraph", "Operator", "OperatorDef", "OperatorError", "format_graph", "operator",
           "optimize", "run_task", "trace_from"]


def optimize(graph: FlowGraph) -> FlowGraph:
    """`graph` optimized by the default pass pipeline under the current `kiln.PassContext`
    (see `kiln.passes`); inputs, outputs and their order are kept."""
    from kiln.passes import optimize as run_pipeline  # passes import graph, never the reverse
    return run_pipeline(graph)
