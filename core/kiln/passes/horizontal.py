"""Horizontal fusion: independent tiny element-wise kernels of one step merged into one launch.

Fusion (`kiln.passes.fusion`) joins a kernel to the kernels that read its values; kernels that
do not depend on each other stay apart, and each tiny one costs a launch of its own: the step
counters of a decoding step's 24 cache layers (`cumulative_length.add_(1)`, written in place by
`kiln.passes.in_place_elements`), a rotary embedding's cos and its sin table. On a GPU a launch
costs microseconds whatever the kernel does, more than such a kernel's memory time.

`MergeIndependentKernels` (run by the torch backend on a GPU graph that is compiled, after the
in-place updates: `kiln.frontend.torch.backend`) walks the nodes in order and merges each small
element-wise node into the last one before it, where neither reads the other's values and no
node between them reads the earlier one's or stores into an input: the group
(`kiln.passes.fused.merged`, several outputs) takes the later one's place, so the earlier moves
down past nodes that never read it, and no dependency changes. The auto-scheduler writes the
independent outputs of such a task in one kernel (`kiln.schedule.cuda_general`: a thread per
element of the largest).

A node takes part where it is an element-wise kernel (an injective task, not a view the compiled
graph runs as none, not a StoreRows store) of fixed sizes, every output of at most
SMALL_ELEMENTS elements, that no template takes; the group stays within GROUP_TENSORS tensors
(a CUDA kernel's parameters are limited), on one device, and no template takes it either. An
output that a node writes into an input's buffer (`kiln.graph.in_place.stored_into`) stays so
only where the group's kernel still reads that input only at the element it writes
(`kiln.graph.compile.loads_own_elements`: no other member reads it); else the two stay apart.
"""
from __future__ import annotations

import math

from kiln.graph import FlowGraph, Operator
from kiln.graph.compile import is_view, loads_own_elements
from kiln.graph.in_place import is_store, stored_into, storing_into
from kiln.passes.edit import merging
from kiln.passes.fused import merged
from kiln.passes.graph_pass import GraphPass
from kiln.schedule.session import CompileSession

SMALL_ELEMENTS = 4096
"""The most elements of each output of a node that merges: a kernel this small costs its launch."""

GROUP_TENSORS = 64
"""The most inputs and outputs, together, of a merged group."""


class MergeIndependentKernels(GraphPass):
    """Merges independent small element-wise kernels into one launch (see the module's
    docstring)."""

    name = "merge_independent_kernels"
    opt_level = 2

    def transform(self, graph: FlowGraph, ctx) -> FlowGraph:
        session = ctx.session
        last = None         # the position among the nodes placed of the last small kernel

        def place(nodes, n, readers):
            nonlocal last
            # a node re-applied to merged inputs is no output of `graph`: a view-like one stays out
            if is_view(n, graph) or not _small_elementwise(n, session):
                nodes.append(n)
                return {}
            if last is not None and _independent(nodes, last, n):
                first = nodes[last]
                group, outputs = _merged(first, n, readers(), session)
                if group is not None:
                    del nodes[last]
                    nodes.append(group)
                    last = len(nodes) - 1
                    return {id(old): new for old, new in zip((*first.outputs, *n.outputs), outputs) if new is not None}
            nodes.append(n)
            last = len(nodes) - 1
            return {}
        return merging(graph, place)


def _small_elementwise(node: Operator, session: CompileSession) -> bool:
    """Whether `node` is an element-wise kernel of fixed sizes whose outputs have at most
    SMALL_ELEMENTS elements each, and no template takes its task."""
    return (node.task.is_injective and not is_store(node)
            and all(type(d) is int for t in (*node.inputs, *node.outputs) for d in t.shape)
            and all(math.prod(t.shape) <= SMALL_ELEMENTS for t in node.outputs)
            and session.template(node.task, node.device) is None)


def _independent(nodes: list[Operator], position: int, node: Operator) -> bool:
    """Whether `nodes[position]` may move down to `node`: the two run on one device, `node` and
    the nodes after `position` read nothing it computes, and none of those stores into an
    input's buffer (the moved kernel may read that input's old value, or a view of it)."""
    first, between = nodes[position], nodes[position + 1:]
    made = {id(t) for t in first.outputs}
    return (first.device == node.device and not any(stored_into(n) for n in between)
            and not any(id(t) in made for n in (*between, node) for t in n.inputs))


def _merged(first: Operator, second: Operator, readers: list, session: CompileSession):
    """(the group of `first` and `second`, its output for each of theirs: None where dropped),
    the outputs either stores into an input's buffer stored so by the group; (None, None) where
    the group would be too large or a template would take it, or its kernel could read a stored
    input elsewhere than at the element it writes."""
    if len(first.inputs) + len(first.outputs) + len(second.inputs) + len(second.outputs) > GROUP_TENSORS:
        return None, None
    group, outputs = merged(first, second, readers)
    if session.template(group.task, group.device) is not None:
        return None, None
    at = {id(t): j for j, t in enumerate(group.outputs)}
    stored = {}
    for node, offset in ((first, 0), (second, len(first.outputs))):
        for k, p in stored_into(node).items():
            stored[at[id(outputs[offset + k])]] = next(j for j, t in enumerate(group.inputs) if t is node.inputs[p])
    if not all(loads_own_elements(group.task, position, output) for output, position in stored.items()):
        return None, None
    for output, position in stored.items():
        group = storing_into(group, output, position)
    return group, [None if t is None else group.outputs[at[id(t)]] for t in outputs]
