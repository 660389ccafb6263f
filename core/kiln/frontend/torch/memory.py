"""Memory of compiled graphs: what each graph of a KilnFunction holds and allocates, in bytes.

`graph_memory(function)` gives a `GraphMemory` per input signature the function compiled:
what the graph holds for as long as it lives (its constants and its workspace of
intermediates), and what each run reads and allocates (its inputs and outputs; of the outputs,
the values a training forward saves for the backward). `Value`s name the largest constants and
saved values by the operator that makes them, to find what to make smaller.

It also counts what a CUDA graph capture of each graph holds (`kiln.runtime.cuda_graph`): a
static buffer for each input it copies in (those not read in place: `bound`), and for each
output copied out (not lent); `captured_workspace` is the one workspace that holds these with
the intermediates, planned by lifetime, which captures on a device share.
"""
from __future__ import annotations

from dataclasses import dataclass

from kiln.tensor import Tensor


@dataclass(frozen=True)
class Value:
    """One tensor of a graph: its signature, bytes, and what makes it (the display name of the
    operator computing it, 'input' or 'constant')."""
    signature: str
    nbytes: int
    made_by: str


@dataclass(frozen=True)
class GraphMemory:
    """Bytes of one compiled graph. `constants` and `workspace` live as long as the graph;
    `inputs` are read by a run; `outputs` are allocated by each run, and `saved` (part of
    them) are a training forward's outputs kept for the backward. `intermediates` is what the
    workspace would take without reuse. `largest_constants`, `largest_saved` and
    `largest_intermediates` are those values, largest first. `copied_in` and `copied_out` are the
    bytes of the inputs a CUDA graph capture copies in and of the outputs copied out of it;
    `captured_workspace` the workspace holding them with the intermediates."""
    constants: int
    workspace: int
    intermediates: int
    inputs: int
    outputs: int
    saved: int
    largest_constants: list[Value]
    largest_saved: list[Value]
    largest_intermediates: list[Value]
    copied_in: int = 0
    copied_out: int = 0
    captured_workspace: int = 0


def _nbytes(t: Tensor) -> int:
    return int(t.numel()) * t.dtype.nbytes


def _value(t: Tensor, inputs: set[int]) -> Value:
    made_by = t.trace[0].name if t.trace is not None else "input" if id(t) in inputs else "constant"
    return Value(t.signature(), _nbytes(t), made_by)


def _largest(tensors, inputs: set[int]) -> list[Value]:
    return sorted((_value(t, inputs) for t in tensors), key=lambda v: -v.nbytes)


def _distinct(tensors) -> list[Tensor]:
    return list({id(t): t for t in tensors}.values())


def graph_memory(function, bound: set[int] | None = None) -> list[GraphMemory]:
    """The memory of each graph `function` (a `KilnFunction`) compiled, most recently used last;
    a capture reads in place the inputs at positions `bound` of the function's arguments (its
    `static_inputs` by default: a training forward's parameters) and copies in the others."""
    bound = function.static_inputs if bound is None else bound
    out = []
    for run in function.graphs.values():
        if run.graph is None:
            raise ValueError(f"graph {function.compile_id} came from the whole-graph cache, which keeps no "
                             "FlowGraph to count: compile with options={'graph_cache': False}")
        graph, compiled = run.graph, run.graph.compile()
        inputs = {id(t) for t in graph.inputs}
        made = _distinct(t for t in graph.outputs if id(t) not in inputs and t.trace is not None)
        # what a forward lends is what it saves for the backward; a backward lends its gradients
        saved = _distinct(graph.outputs[k] for k in run.lent) if function.lent_from else []
        saved_made = [t for t in saved if t.trace is not None]
        returned = {id(t) for t in graph.outputs}
        intermediates = [t for node in graph.nodes for t in node.outputs if id(t) not in returned]
        copied_in = [j for j, p in enumerate(run.positions) if p not in bound]
        lent = set(run.lent)
        copied_out = [k for k in range(len(compiled.outputs)) if k not in lent]
        transient = compiled.transient_slots(copied_in, copied_out)
        out.append(GraphMemory(
            constants=sum(t.numel() * t.element_size() for t in compiled.constants.values()),
            workspace=compiled.workspace_bytes,
            intermediates=compiled.intermediate_bytes,
            inputs=sum(_nbytes(t) for t in graph.inputs),
            outputs=sum(_nbytes(t) for t in made),
            saved=sum(_nbytes(t) for t in saved_made),
            largest_constants=_largest(graph.constants, inputs),
            largest_saved=_largest(saved, inputs),
            largest_intermediates=_largest(intermediates, inputs),
            copied_in=sum(compiled.buffers[compiled.inputs[j]].nbytes for j in copied_in),
            copied_out=sum(compiled.buffers[s].nbytes for s in transient if s not in compiled.inputs),
            captured_workspace=sum(p.size for p in compiled.plans_with(transient).values())))
    return out
