"""Element-wise updates of whole inputs, written in place: a counter's `add_(1)` with no copy.

A graph that changes an input in place by an element-wise computation of the input itself
(transformers' StaticCache: `cumulative_length.add_(1)` in every layer) is traced as a pure
graph whose output, the new value, is written back into the caller's tensor after the graph: a
kernel computing the new value, then a copy (on CUDA, a node of the CUDA graph). Where the
kernel reads element p of the input only where it writes element p of that output,
`elements_in_place` marks its node (`kiln.graph.in_place.storing_into`) so that the compiled
graph gives the output the input's own buffer: the kernel writes the new value where it read
the old one, and the written-back output is the input itself (no copy: `CompiledRun` skips it,
a CUDA graph captures none).

Correctness rules (those of `kiln.passes.in_place`):
- the node is an injective task (no template takes it: an element-wise kernel) reading the
  input once, whose output reads the input's element p only at its own element p (directly or
  through values of the same shape it reads at its own element), and whose other outputs do
  not read the input at all (`kiln.graph.compile.loads_own_elements`);
- the node moves down to just before the first node reading one of its outputs; a node from
  there on that reads the input's old value, or a view of it (a node the compiled graph runs
  on the input's memory: `kiln.graph.compile.is_view`), keeps the update out of place, as does
  a graph output that is the input itself;
- sizes must be fixed, and the output has the input's shape and dtype.

An input the caller passes non-contiguous is made contiguous for the run (as every input is):
the kernel writes that copy and the write-back copies it into the caller's tensor, as before.
"""
from __future__ import annotations

from kiln.graph import FlowGraph
from kiln.graph.compile import is_view, loads_own_elements
from kiln.graph.in_place import stored_into, storing_into
from kiln.passes.edit import reapply
from kiln.schedule.session import CompileSession
from kiln.tensor import Tensor


def elements_in_place(graph: FlowGraph, out: int, target: Tensor, session: CompileSession) -> FlowGraph | None:
    """`graph` with its output `out`, an element-wise update of the input `target`, written
    into `target`'s buffer by the kernel computing it; None where that is not possible or not
    safe (see the module's docstring). `session` says which tasks a template takes."""
    value = graph.outputs[out]
    if (value.trace is None or any(t is target for t in graph.outputs) or tuple(value.shape) != tuple(target.shape)
            or value.dtype != target.dtype or not all(type(d) is int for d in target.shape)):
        return None
    node, k = value.trace
    reads = [j for j, t in enumerate(node.inputs) if t is target]
    if (len(reads) != 1 or not node.task.is_injective or k in stored_into(node)
            or session.template(node.task, node.device) is not None
            or not loads_own_elements(node.task, reads[0], k)):
        return None
    made = {id(t) for t in node.outputs}
    rest = [n for n in graph.nodes if n is not node]
    at = next((i for i, n in enumerate(rest) if any(id(t) in made for t in n.inputs)), len(rest))
    old = {id(target)}      # the input's old value, and views of it (which share its memory)
    for i, n in enumerate(rest):
        if any(id(t) in old for t in n.inputs):
            if i >= at:
                return None         # reads the input's old value after the kernel wrote it
            if is_view(n, graph):
                old.update(id(t) for t in n.outputs)
    marked = storing_into(node, k, reads[0])
    mapping = dict(zip(map(id, node.outputs), marked.outputs))
    nodes = [marked]
    for n in rest[at:]:
        inputs = [mapping.get(id(t), t) for t in n.inputs]
        if any(a is not b for a, b in zip(inputs, n.inputs)):
            outs = reapply(n, inputs)
            mapping.update(zip(map(id, n.outputs), outs))
            n = outs[0].trace[0]
        nodes.append(n)
    return FlowGraph([mapping.get(id(t), t) for t in graph.outputs], graph.inputs, rest[:at] + nodes)
