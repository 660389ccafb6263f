"""Tables the backend prints: the input graph, and the correctness report against PyTorch.

The error of a value is the largest, over its elements, harmonic mean of the absolute error
|a - e| and the relative error |a - e| / |e| of Kiln's value a against PyTorch's e, which is
2 |a - e| / (1 + |e|). Both sides run the whole graph on the same inputs, so errors build up
along the graph as they would in the compiled model. The report checks the fx nodes (the
mapping rules) and each kernel of the optimized graph (what the graph passes made of them).
"""
from __future__ import annotations

import copy

import torch
from torch.fx import GraphModule, Interpreter as TorchInterpreter, Node
from torch.fx.node import map_aggregate

from kiln.frontend.torch.errors import target_name
from kiln.graph import FlowGraph
from kiln.runtime.compiled_graph import Step
from kiln.table import format_table
from kiln.tensor import Tensor

ATTENTION = {torch.float16: 1e-2, torch.bfloat16: 1e-2}
DEFAULT_ATTENTION = 1e-5


def input_graph_table(gm: GraphModule) -> str:
    """The graph dynamo hands over: opcode, name, target, args, kwargs of every node."""
    rows = [(n.op, n.name, n.target if isinstance(n.target, str) else repr(n.target),
             n.args, n.kwargs) for n in gm.graph.nodes]
    return format_table(rows, ("opcode", "name", "target", "args", "kwargs"))


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


def run_steps(graph: FlowGraph, inputs: list[torch.Tensor]) -> dict[int, torch.Tensor]:
    """Run `graph`'s CompiledGraph on `inputs`, kernel by kernel; return the value of every
    tensor of the graph (inputs, constants and each node's outputs) by the tensor's id."""
    compiled = graph.compile()
    values = {id(t): v for t, v in zip(graph.inputs, inputs)}
    values.update({id(t): t.torch() for t in graph.constants})
    captured: list[list[torch.Tensor]] = []

    def watch(kernel):
        def call(ins, outs):
            kernel(ins, outs)
            captured.append([o.clone() for o in outs])
        return call

    stepwise = copy.copy(compiled)
    stepwise.steps = [Step(watch(s.kernel), s.inputs, s.outputs) for s in compiled.steps]
    stepwise.run(inputs)
    for node, outs in zip(graph.nodes, captured):
        values.update({id(t): v for t, v in zip(node.outputs, outs)})
    return values


def _pytorch_values(gm: GraphModule, inputs: list) -> dict[Node, object]:
    expected: dict[Node, object] = {}

    class Recorder(TorchInterpreter):
        def run_node(self, n):
            expected[n] = super().run_node(n)
            return expected[n]

    with torch.no_grad():
        Recorder(gm).run(*[x.clone() if isinstance(x, torch.Tensor) else x for x in inputs])
    return expected


def _limit(value) -> float:
    return ATTENTION.get(value.dtype, DEFAULT_ATTENTION) if isinstance(value, torch.Tensor) \
        else DEFAULT_ATTENTION


def _flag(error, limit) -> str:
    return "<------" if error is not None and error > limit else ""


def correctness_report(gm: GraphModule, inputs: list, traced_values: dict[Node, object],
                       traced: FlowGraph, optimized: FlowGraph) -> str:
    """Two tables of errors against PyTorch on the same `inputs` (the graph's arguments):

    - each fx node: Kiln's value, from the traced (unoptimized) graph run kernel by kernel;
    - each kernel of the optimized graph, which is what runs: its outputs against the closest
      reference of the same shape, a PyTorch value of an fx node or a value of the traced
      graph (a rule may make several Kiln operators of one fx node). A kernel that matches
      none is off; the first flagged kernel is where the error starts.

    `traced_values` maps each fx node to its (symbolic) value in `traced`; `optimized` is
    `traced` after the graph passes."""
    expected = _pytorch_values(gm, inputs)
    placeholders = [v for n, v in traced_values.items() if n.op == "placeholder"]
    positions = {id(v): k for k, v in enumerate(placeholders)}
    run_inputs = [inputs[positions[id(t)]] for t in traced.inputs]
    kiln_values = run_steps(traced, run_inputs)
    rows = []
    for node, value in traced_values.items():
        if node.op == "output":
            continue
        exp = expected.get(node)
        leaves_a, leaves_e = [], []
        map_aggregate(value, lambda v: leaves_a.append(_concrete(v, kiln_values)))
        map_aggregate(exp, leaves_e.append)
        errors = [node_error(a, e) for a, e in zip(leaves_a, leaves_e)]
        errors = [x for x in errors if x is not None]
        error = max(errors) if errors else None
        dtype = next((d for d in map(_dtype_of, leaves_e) if d), "")
        limit = next((_limit(e) for e in leaves_e if isinstance(e, torch.Tensor)), DEFAULT_ATTENTION)
        rows.append((len(rows), node.op, _operator_text(gm, node), dtype,
                     "" if error is None else f"{error:.1e}", _flag(error, limit)))
    nodes_table = format_table(rows, ("", "kind", "operator", "dtype", "error", "attention"))
    return (f"fx nodes (Kiln's operators before the graph passes):\n{nodes_table}\n\n"
            f"kernels that run (the optimized graph):\n"
            f"{_kernel_table(traced, traced_values, expected, kiln_values, optimized, run_inputs)}")


def _concrete(value, values: dict[int, torch.Tensor]):
    if isinstance(value, Tensor):
        return value.torch() if not value.is_symbolic else values.get(id(value))
    return value


def _kernel_table(traced, traced_values, expected, kiln_values, optimized, run_inputs) -> str:
    references: list[tuple[str, torch.Tensor]] = []
    for node, value in traced_values.items():
        leaves = []
        map_aggregate(expected.get(node), leaves.append)
        references += [(node.name, e) for e in leaves if isinstance(e, torch.Tensor)]
    references += [(f"kiln {op.name}", kiln_values[id(t)]) for op in traced.nodes
                   for t in op.outputs]
    actual = run_steps(optimized, run_inputs)
    rows = []
    for node in optimized.nodes:
        fused = getattr(node, "fused_graph", None)
        members = "+".join(m.name for m in fused.nodes) if fused is not None else ""
        made_by = [m.trace[0].name for m in fused.outputs] if fused is not None else \
            [node.name] * len(node.outputs)
        for t, maker in zip(node.outputs, made_by):
            value = actual[id(t)]
            same = [(name, ref) for name, ref in references if tuple(ref.shape) == tuple(value.shape)]
            # a kernel is compared with the values of its own operator where there are some
            same = [r for r in same if r[0] == f"kiln {maker}"] or same
            scored = [(node_error(value, ref), name) for name, ref in same]
            error, closest = min(scored, key=lambda s: s[0], default=(None, "(no value of this shape)"))
            rows.append((len(rows), node.name, members, f"{t.dtype}[{','.join(map(str, t.shape))}]",
                         "" if error is None else f"{error:.1e}", closest,
                         "<------" if error is None or error > _limit(value) else ""))
    return format_table(rows, ("", "kernel", "fused operators", "output", "error",
                               "closest reference", "attention"))
