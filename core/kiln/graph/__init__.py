"""Operators and flow graphs: definitions, nodes, tracing, printing and execution."""
from kiln.graph.flow_graph import FlowGraph, format_graph, trace_from
from kiln.graph.operator import Operator, OperatorDef, OperatorError, operator, run_task
from kiln.graph.optimizer import optimize

__all__ = ["FlowGraph", "Operator", "OperatorDef", "OperatorError", "format_graph", "operator",
           "optimize", "run_task", "trace_from"]
