"""FlowGraph: a data-flow graph of operators, traced from symbolic tensors."""
from __future__ import annotations

import inspect
import math
from typing import Callable, Sequence

import torch

from kiln.graph.compile import compile_graph
from kiln.graph.operator import Operator, OperatorError
from kiln.ir import size_reads
from kiln.ir.size import guards_hold
from kiln.runtime.compiled_graph import CompiledGraph
from kiln.runtime.cuda_graph import CapturedGraph, capture
from kiln.runtime.plan_binding import bound
from kiln.tensor import Tensor, from_torch


class FlowGraph:
    """Operators in topological order between graph inputs and outputs.

    Tensors that no operator of the graph produces and that are not inputs are constants.
    Calling the graph with tensors runs it through its CompiledGraph (built on first use; graphs
    are not edited afterwards: passes build new ones).
    """

    def __init__(self, outputs: Sequence[Tensor], inputs: Sequence[Tensor], nodes: Sequence[Operator]):
        self.outputs = list(outputs)
        self.inputs = list(inputs)
        self.nodes = list(nodes)
        self._compiled: CompiledGraph | None = None

    @property
    def constants(self) -> list[Tensor]:
        seen, out = set(), []
        inputs = {id(t) for t in self.inputs}
        for node in self.nodes:
            for t in node.inputs:
                if t.trace is None and id(t) not in inputs and id(t) not in seen:
                    seen.add(id(t))
                    out.append(t)
        return out

    def __call__(self, *inputs):
        outs = self.run(list(inputs))
        return outs[0] if len(outs) == 1 else tuple(outs)

    def compile(self, settings=None) -> CompiledGraph:
        """This graph's CompiledGraph: every kernel built (in parallel, with `settings`, a
        `kiln.settings.Settings`: those in effect when None) and a memory plan placing the intermediates in one
        workspace per device. Built once, then cached."""
        if self._compiled is None:
            self._compiled = compile_graph(self, settings)
        return self._compiled

    def run(self, inputs: Sequence) -> list[Tensor]:
        """Run the graph on concrete tensors (Kiln or torch); return the outputs."""
        if len(inputs) != len(self.inputs):
            raise OperatorError(f"graph takes {len(self.inputs)} inputs, got {len(inputs)}")
        values: list[torch.Tensor] = []
        for sym, value in zip(self.inputs, inputs):
            t = value.torch() if isinstance(value, Tensor) else value
            if tuple(t.shape) != sym.shape or t.dtype != sym.dtype.torch_dtype:
                raise OperatorError(f"graph input expects {sym.signature()}, got "
                                    f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}")
            values.append(t)
        return [from_torch(t) for t in self.compile().run(values)]

    def cuda_graph(self, example_inputs: Sequence | None = None, write_back: Sequence[tuple[int, int]] = (),
                   lent: Sequence[int] = (), bound: Sequence[int] = ()) -> CapturedGraph:
        """This graph's CompiledGraph captured in a CUDA graph: an object whose `run(inputs)`
        replays its steps over its fixed workspace (see `kiln.runtime.cuda_graph`). The graph's
        inputs must be on a CUDA device; `example_inputs` (random by default) are only used for
        the capture. Each pair (output, input) of `write_back` makes the replay copy that
        output into that input, which the graph then takes in place (bound at the example's
        memory): replays update the caller's tensor and return the other outputs only. Of
        those, the positions `lent` that the graph allocates itself (not inputs or constants)
        are lent rather than copied; the inputs at positions `bound` are read in place."""
        if example_inputs is None:
            example_inputs = [torch.randn(t.shape, device=t.device.torch()).to(t.dtype.torch_dtype)
                              for t in self.inputs]
        examples = [t.torch() if isinstance(t, Tensor) else t for t in example_inputs]
        return capture(self.compile(), examples, write_back, wrap=from_torch, lent=lent, bound=bound)

    def __str__(self) -> str:
        return format_graph(self)

    def __repr__(self) -> str:
        return f"FlowGraph({', '.join(n.name for n in self.nodes)})"


def shown_attrs(node: Operator) -> dict:
    """The attributes of `node` that differ from its definition's defaults (which printing omits)."""
    params = node.definition.signature.parameters
    out = {}
    for k, v in node.attrs.items():
        default = params[k].default if k in params else inspect.Parameter.empty
        if not (type(v) is type(default) and v == default):
            out[k] = v
    return out


def format_graph(graph: FlowGraph) -> str:
    """The graph in Kiln's text format (inputs, constants, one line per operator, return).

    Each operator line shows its tensor arguments and the attributes not left at their default.
    """
    names: dict[int, str] = {}
    counter = {"x": 0, "c": 0}

    def fresh(base: str) -> str:
        n = counter[base]
        counter[base] += 1
        return base if n == 0 else f"{base}_{n}"

    for t in graph.inputs:
        names[id(t)] = fresh("x")
    lines = []
    for c in graph.constants:
        names[id(c)] = fresh("c")
        lines.append(f"  {names[id(c)]} = Constant({c.signature()})")
    for node in graph.nodes:
        outs = []
        for t in node.outputs:
            names[id(t)] = fresh("x")
            outs.append(f"{names[id(t)]}: {t.signature()}")
        args = [names[id(t)] for t in node.inputs]
        args += [f"{k}={v!r}" for k, v in shown_attrs(node).items()]
        lines.append(f"  {', '.join(outs)} = {node.name}({', '.join(args)})")
    ins = ", ".join(f"{names[id(t)]}: {t.signature()}" for t in graph.inputs)
    ret = ", ".join(names.get(id(t), "?") for t in graph.outputs)
    return f"Graph({ins}){{\n" + "\n".join(lines) + f"\n  return {ret}\n}}"


def trace_from(outputs, inputs=None) -> FlowGraph:
    """The FlowGraph computing the symbolic tensor(s) `outputs` from `inputs`.

    Without `inputs`, the graph's inputs are the symbolic tensors the outputs depend on, in the
    order a depth-first walk from the outputs meets them. The walk takes an operator's inputs in
    order, but those made by operators that read no tensor (a fill, a range) last: such an
    operator runs just before its first reader, and its buffer is not held while the reader's
    other inputs are computed (AOTAutograd's backward makes an embedding gradient's zero fill
    first, and it was held through the whole backward).
    """
    outputs = [outputs] if isinstance(outputs, Tensor) else list(outputs)
    nodes, found_inputs = _walk(outputs, by_memory=False)
    if inputs is None:
        inputs = found_inputs
    else:
        inputs = [inputs] if isinstance(inputs, Tensor) else list(inputs)
        missing = [t for t in found_inputs if all(t is not i for i in inputs)]
        if missing:
            raise ValueError(f"the outputs depend on {len(missing)} symbolic tensor(s) not given "
                             f"as inputs: {', '.join(t.signature() for t in missing)}")
    return FlowGraph(outputs, inputs, nodes)


def in_memory_order(graph: FlowGraph) -> FlowGraph:
    """`graph` with its operators reordered to hold fewer intermediates at once (a smaller
    workspace), for the graph that is compiled. The walk from the outputs takes an operator's
    inputs deepest first (the longest chain of operators from the graph's inputs), so that a
    shallow input runs just before its reader and is not held while the reader's deep inputs
    are computed; and an operator that an operator just placed makes ready runs at once where
    the intermediates it makes are no larger than those it reads for the last time (a weight's
    gradient, freeing the gradient it reads), instead of when the walk reaches its output, with
    those of its producers that read only graph inputs (the transposed saved activation a
    convolution's weight gradient reads). A training backward walked in `trace_from`'s order
    computed each layer's weight gradients when the walk reached them, in the order of the
    outputs, holding the gradients they read through most of the backward. Fusion depends on
    the order of a graph's operators: this order is for the compiled graph only, after the
    passes."""
    nodes, _ = _walk(graph.outputs, by_memory=True)
    return FlowGraph(graph.outputs, graph.inputs, nodes)


def _walk(outputs: list[Tensor], by_memory: bool) -> tuple[list[Operator], list[Tensor]]:
    """The operators computing `outputs` in the order of `trace_from` or, `by_memory`, of
    `in_memory_order`; and the symbolic tensors met that no operator makes."""
    nodes, seen, found_inputs = [], set(), []

    def enter(t: Tensor):
        """The operator producing `t` where it is met for the first time, else None (an input
        met for the first time is recorded)."""
        if t.trace is None:
            if t.is_symbolic and id(t) not in seen:
                seen.add(id(t))
                found_inputs.append(t)
            return None
        op = t.trace[0]
        if id(op) in seen:
            return None
        seen.add(id(op))
        return op

    if by_memory:
        depths, readers = _depths_and_readers(_walk(outputs, by_memory=False)[0])
        returned = {id(t) for t in outputs}
        placed: set[int] = set()

        def in_walk_order(op):
            return iter(sorted(op.inputs, key=lambda x: -depths[id(x.trace[0])] if x.trace is not None else 0))

        def runnable_with(op) -> list[Operator] | None:
            """The operators to run with `op` now, before it, where it can run and holds no more
            memory once run: its unplaced producers that read only graph inputs and constants
            (a saved activation's transpose for a weight's gradient), where the intermediates
            they and `op` make are no larger than those `op` reads last. None otherwise."""
            producers = [x.trace[0] for x in op.inputs if x.trace is not None and id(x.trace[0]) not in placed]
            if any(id(p) in seen or any(i.trace is not None for i in p.inputs) for p in producers):
                return None
            pulled = list({id(p): p for p in producers}.values())
            made = sum(_nbytes(t) for p in (*pulled, op) for t in p.outputs if id(t) not in returned)
            freed = sum(_nbytes(x) for x in dict.fromkeys(op.inputs) if x.trace is not None and id(x) not in returned
                        and all(id(r) in placed or r is op for r in readers[id(x)]))
            return pulled if made <= freed else None

        def place(op):
            work = [op]
            while work:
                op = work.pop()
                nodes.append(op)
                placed.add(id(op))
                near = [r for x in op.inputs if x.trace is not None for r in readers[id(x)]]
                for r in dict.fromkeys(readers.get(id(op), []) + near):
                    pulled = None if id(r) in seen else runnable_with(r)
                    if pulled is not None:
                        seen.update(id(p) for p in (r, *pulled))
                        work += [r, *pulled]        # the producers first
    else:
        def in_walk_order(op):
            return iter(sorted(op.inputs, key=lambda x: x.trace is not None and not x.trace[0].inputs))
        place = nodes.append

    # depth first, each operator after its inputs', with a stack of its own: a graph is deeper
    # than Python's recursion limit (a thousand operators in a chain)
    for t in outputs:
        op = enter(t)
        stack = [] if op is None else [(op, in_walk_order(op))]
        while stack:
            op, pending = stack[-1]
            for x in pending:
                child = enter(x)
                if child is not None:
                    stack.append((child, in_walk_order(child)))
                    break
            else:
                stack.pop()
                place(op)
    return nodes, found_inputs


def _depths_and_readers(order: list[Operator]) -> tuple[dict[int, int], dict[int, list[Operator]]]:
    """For each operator of `order` (each after its producers), by id: the longest chain of
    operators from the graph's inputs to it (0 for one reading no tensor, 1 for one reading only
    inputs and constants); and the operators reading each operator and each tensor it makes."""
    depths: dict[int, int] = {}
    readers: dict[int, list[Operator]] = {}
    for op in order:
        producers = [x.trace[0] for x in op.inputs if x.trace is not None]
        depths[id(op)] = 1 + max((depths[id(p)] for p in producers), default=0 if op.inputs else -1)
        for key in dict.fromkeys([id(p) for p in producers] + [id(x) for x in op.inputs if x.trace is not None]):
            readers.setdefault(key, []).append(op)
    return depths, readers


def _nbytes(t: Tensor) -> int:
    """The bytes of `t`: a symbolic size where its shape is one, so that comparing two such
    counts records a guard (`kiln.ir.size_reads`), which a plan reused at other sizes checks,
    not a read of a size's value, which would keep the plan from serving other sizes."""
    return math.prod(t.shape) * t.dtype.nbytes


def known_value(t: Tensor) -> torch.Tensor | None:
    """The values of `t` where they are known before its graph runs: a constant's, or those of a
    generated tensor (computed from no data; see `kiln.graph.tracing`), computed now; None for a
    tensor that depends on the graph's inputs."""
    if not t.is_symbolic:
        return t.torch()
    if not t.generated:
        return None
    return trace_from(t, []).run([])[0].torch()


def known_value_at(t: Tensor) -> Callable[[dict | None], torch.Tensor | None] | None:
    """Where the values of `t` are known before its graph runs (`known_value`), for a shape that
    may be symbolic: a function of the size variables' values (name -> int; None: this trace's)
    giving them there, without reading a size's value in this trace. A generated tensor's graph
    is built once, its sizes kernel arguments, reading them through comparisons only; at sizes
    where one of those answers otherwise the function gives None. None where `t` depends on the
    graph's inputs, or building its graph read a size's value."""
    if not t.is_symbolic:
        value = t.torch()
        return lambda values=None: value
    if not t.generated:
        return None
    with size_reads.recording() as reads:
        plan = trace_from(t, []).compile().plan
    if reads.read is not None:
        return None

    def at(values: dict | None = None) -> torch.Tensor | None:
        if values is not None and not guards_hold(reads.guards, values):
            return None
        return bound(plan, values).assemble().run([])[0]
    return at
