"""Editing helpers shared by the passes: the producer and the users of tensors, re-applying an
operator to new inputs, and rebuilding a graph node by node (each node re-applied or replaced,
or placed into the nodes so far by a function that may merge it into one of them)."""
from __future__ import annotations

from typing import Callable, Sequence

from kiln.graph import FlowGraph, Operator, trace_from
from kiln.tensor import Tensor


def producer(t: Tensor) -> Operator | None:
    """The node that computes `t` in its traced graph, or None for a graph input or a constant."""
    return t.trace[0] if t.trace is not None else None


def users(graph: FlowGraph) -> dict[int, list[Operator]]:
    """The nodes reading each tensor (by id), each node once, in graph order."""
    out: dict[int, list[Operator]] = {}
    for node in graph.nodes:
        for t in {id(t): t for t in node.inputs}.values():
            out.setdefault(id(t), []).append(node)
    return out


def arguments_of(node: Operator) -> dict:
    """The arguments, by parameter name, that re-create `node` with its definition."""
    inputs = dict(zip((spec.name for spec in node.task.inputs), node.inputs))
    args = {}
    for name in node.definition.signature.parameters:
        if name in node.attrs:
            args[name] = node.attrs[name]
        elif name in inputs:
            args[name] = inputs[name]
        else:
            args[name] = [t for spec_name, t in inputs.items()
                          if spec_name.startswith(name) and spec_name[len(name):].isdigit()]
    return args


def reapply(node: Operator, inputs: Sequence[Tensor]) -> list[Tensor]:
    """The outputs of `node` computed from `inputs` instead of its own inputs: the node
    itself where nothing changed, a new node otherwise (run at once where every input is
    concrete, which is how constant folding happens)."""
    if all(a is b for a, b in zip(inputs, node.inputs)):
        return node.outputs
    if hasattr(node, "with_inputs"):
        return node.with_inputs(inputs).outputs
    same = all(a.shape == b.shape and a.dtype == b.dtype for a, b in zip(inputs, node.inputs))
    if same:
        return Operator(node.definition, inputs, node.attrs, node.task, node.device).outputs
    return remake(node, inputs)


def remake(node: Operator, inputs: Sequence[Tensor], **changes) -> list[Tensor]:
    """The outputs of `node`'s definition applied again to its arguments, its tensors replaced
    by `inputs` (position for position) and the arguments named in `changes` set to theirs:
    a new node, checked and tasked by the definition."""
    args = arguments_of(node)
    swap = {id(old): new for old, new in zip(node.inputs, inputs)}
    for k, v in args.items():
        if isinstance(v, Tensor):
            args[k] = swap.get(id(v), v)
        elif isinstance(v, list) and v and all(isinstance(x, Tensor) for x in v):
            args[k] = [swap.get(id(x), x) for x in v]
    outs = node.definition(**{**args, **changes})
    return list(outs) if isinstance(outs, tuple) else [outs]


Rewrite = Callable[[Operator, list[Tensor]], "Sequence[Tensor] | None"]


def rebuild(graph: FlowGraph, rewrite: Rewrite | None = None) -> FlowGraph:
    """A new graph with each node (in order) replaced by `rewrite(node, new_inputs)`'s outputs,
    or re-applied to its new inputs where `rewrite` returns None. Graph inputs and the order
    of outputs are kept; nodes nothing uses any more are dropped. A replacement may be built
    on the old graph's tensors (a rewrite found before the graph changed upstream of it): it
    is computed again from their new versions."""
    mapping: dict[int, Tensor] = {}
    made: set[int] = set()          # the ids of the new graph's tensors made so far
    for node in graph.nodes:
        inputs = [mapping.get(id(t), t) for t in node.inputs]
        outs = rewrite(node, inputs) if rewrite is not None else None
        outs = reapply(node, inputs) if outs is None else _rebased(outs, mapping, made)
        for old, new in zip(node.outputs, outs):
            mapping[id(old)] = new
            made.add(id(new))
    return trace_from([mapping.get(id(t), t) for t in graph.outputs], graph.inputs)


def _rebased(tensors: Sequence[Tensor], mapping: dict[int, Tensor], made: set[int]) -> list[Tensor]:
    """`tensors` computed from the new versions (`mapping`, by old id) of the old tensors they
    read; the new graph's own tensors (`made`), inputs and constants are read as they are."""
    redone: dict[int, Tensor] = {}

    def new(t: Tensor) -> Tensor:
        if id(t) in mapping:
            return mapping[id(t)]
        node = producer(t)
        if id(t) in made or node is None:
            return t
        if id(t) not in redone:
            for old, out in zip(node.outputs, reapply(node, [new(x) for x in node.inputs])):
                redone[id(old)] = out
        return redone[id(t)]

    return [new(t) for t in tensors]


def merging(graph: FlowGraph, place) -> FlowGraph:
    """`graph` rebuilt node by node: each node, reading what earlier merges replaced, goes to
    `place(nodes, node, readers)`, which appends it to `nodes` or merges it into one of them
    and returns the replacements made (old tensor id -> new tensor); `readers()` gives the
    tensors read after it (by later nodes and as outputs), as they are now."""
    nodes: list[Operator] = []
    mapping: dict[int, Tensor] = {}

    def current(t: Tensor) -> Tensor:
        while id(t) in mapping:
            t = mapping[id(t)]
        return t
    for i, n in enumerate(graph.nodes):
        inputs = [current(t) for t in n.inputs]
        if any(a is not b for a, b in zip(inputs, n.inputs)):
            outs = reapply(n, inputs)
            mapping.update(zip(map(id, n.outputs), outs))
            n = outs[0].trace[0]
        later = graph.nodes[i + 1:]
        mapping.update(place(nodes, n, lambda: [current(t) for m in later for t in m.inputs] +
                             [current(t) for t in graph.outputs]))
    if not mapping:
        return graph
    return FlowGraph([current(t) for t in graph.outputs], graph.inputs, nodes)
