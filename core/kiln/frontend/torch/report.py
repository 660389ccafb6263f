"""Tables the backend prints: the input graph, and the correctness report against PyTorch.

The error of a node is the largest, over its elements, harmonic mean of the absolute error
|a - e| and the relative error |a - e| / |e| of Kiln's value a against PyTorch's e, which is
2 |a - e| / (1 + |e|). Both sides run the whole graph on the same inputs, so errors build up
along the graph as they would in the compiled model.
"""
from __future__ import annotations

import torch
from torch.fx import GraphModule, Interpreter as TorchInterpreter, Node
from torch.fx.node import map_aggregate

from kiln.frontend.torch.errors import target_name
from kiln.frontend.torch.interpreter import Interpreter
from kiln.tensor import Tensor, from_torch

ATTENTION = {torch.float16: 1e-2, torch.bfloat16: 1e-2}
DEFAULT_ATTENTION = 1e-5


def format_table(headers, rows) -> str:
    """A plain-text table: a header line, a rule of dashes, then one line per row."""
    cells = [[str(c) for c in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[k]) for r in cells) for k in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def input_graph_table(gm: GraphModule) -> str:
    """The graph dynamo hands over: opcode, name, target, args, kwargs of every node."""
    rows = [(n.op, n.name, n.target if isinstance(n.target, str) else repr(n.target),
             n.args, n.kwargs) for n in gm.graph.nodes]
    return format_table(("opcode", "name", "target", "args", "kwargs"), rows)


def node_error(actual, expected) -> float | None:
    """The harmonic-mean error of one value against PyTorch's (None for non-tensors)."""
    if not isinstance(expected, torch.Tensor):
        return None
    a = actual.torch() if isinstance(actual, Tensor) else actual
    if not isinstance(a, torch.Tensor) or a.shape != expected.shape:
        return float("inf")
    if expected.numel() == 0:
        return 0.0
    a, e = a.detach().double(), expected.detach().double()
    both_nan = a.isnan() & e.isnan()
    err = torch.where(both_nan, 0.0, 2 * (a - e).abs() / (1 + e.abs()))
    return float(err.nan_to_num(nan=float("inf")).max())


def _operator_text(gm: GraphModule, node: Node) -> str:
    if node.op == "call_module":
        return str(gm.get_submodule(node.target)).replace("\n", " ")
    if node.op == "call_method":
        return target_name("method", node.target)
    if node.op == "call_function":
        return target_name("function", node.target)
    return ""


def _dtype_of(value) -> str:
    if isinstance(value, Tensor):
        return str(value.dtype)
    if isinstance(value, torch.Tensor):
        return str(value.dtype).replace("torch.", "")
    return ""


def correctness_report(gm: GraphModule, inputs: list) -> str:
    """Run the graph in Kiln (operator by operator) and in PyTorch on `inputs`; tabulate errors."""
    expected: dict[Node, object] = {}

    class Recorder(TorchInterpreter):
        def run_node(self, n):
            expected[n] = super().run_node(n)
            return expected[n]

    with torch.no_grad():
        Recorder(gm).run(*[x.clone() if isinstance(x, torch.Tensor) else x for x in inputs])
    rows = []

    def record(node: Node, value) -> None:
        if node.op == "output":
            return
        exp = expected.get(node)
        leaves_a, leaves_e = [], []
        map_aggregate(value, leaves_a.append)
        map_aggregate(exp, leaves_e.append)
        errors = [node_error(a, e) for a, e in zip(leaves_a, leaves_e)]
        errors = [x for x in errors if x is not None]
        error = max(errors) if errors else None
        dtype = next((d for d in map(_dtype_of, leaves_e) if d), "")
        limit = next((ATTENTION.get(e.dtype, DEFAULT_ATTENTION) for e in leaves_e
                      if isinstance(e, torch.Tensor)), DEFAULT_ATTENTION)
        rows.append((len(rows), node.op, _operator_text(gm, node), dtype,
                     "" if error is None else f"{error:.1e}",
                     "<------" if error is not None and error > limit else ""))

    concrete = [from_torch(x) if isinstance(x, torch.Tensor) else x for x in inputs]
    Interpreter(gm).run(concrete, on_node=record)
    return format_table(("", "kind", "operator", "dtype", "error", "attention"), rows)
