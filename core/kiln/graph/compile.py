"""Compiling a FlowGraph into a `kiln.runtime.compiled_graph.CompiledGraph`.

Every tensor of the graph gets a numbered buffer slot; every node becomes a step calling its
operator's built kernel: a `kiln.runtime.plan.Plan`, which assembles the CompiledGraph (where a
kernel lays out a constant input once, `kiln.runtime.cpu.Preparation`: a weight packed as its
GEMM reads it, the prepared form is computed then and becomes one more constant the step
reads). A StoreRows node (in-place updates, `kiln.graph.in_place`) writes into its inputs'
buffers: each output takes its input's slot, as does each output a pass marked stored into
an input (`kiln.graph.in_place.stored_into`: an element-wise update's, or rows a kernel
stores itself). A node of an operator declaring the trait
`in_place` (`kiln.graph.Traits`) takes the slot of that argument where nothing reads it
afterwards (`in_place_input`): a scatter into a zero fill updates the fill. The kernels are built in parallel threads (gcc and NVRTC builds release the GIL), each
distinct task once.
"""
from __future__ import annotations

import contextvars
from concurrent.futures import ThreadPoolExecutor

from kiln.graph.in_place import stored_into
from kiln.graph.operator import Operator, compiled_task
from kiln.ir import Compute, Const, Load
from kiln.ir.expr import walk
from kiln.ir.size import as_dim
from kiln.runtime.backend import DeviceKernel
from kiln.runtime.compiled_graph import Buffer, CompiledGraph, ViewKernel
from kiln.runtime.plan import Plan
from kiln.tensor import Tensor


def is_view(node, graph) -> bool:
    """Whether `node` runs as a view of its input's memory: a node of one input and one output,
    not one the graph returns (those get memory of their own), that keeps the dtype and either
    is of an operator declaring `Traits.view`, on its own (not a fused node, a subclass whose
    task holds more), or copies its input element for element (an expand to the same shape, a
    clone: `copies_input`)."""
    if len(node.inputs) != 1 or len(node.outputs) != 1:
        return False
    out = node.outputs[0]
    return (out.dtype == node.inputs[0].dtype and not any(out is t for t in graph.outputs)
            and ((type(node) is Operator and node.definition.traits.view) or copies_input(node.task)))


def copies_input(task) -> bool:
    """Whether `task`'s one output is its one input, element for element: the output's value is
    a load of the input at the output's own index (0 along extent-1 dims)."""
    if len(task.inputs) != 1 or len(task.outputs) != 1 or not isinstance(task.outputs[0], Compute):
        return False
    out, x = task.outputs[0], task.inputs[0]
    value = out.value
    return (isinstance(value, Load) and value.tensor is x and tuple(x.shape) == tuple(out.shape)
            and value.dtype == x.dtype
            and all(i is axis or (axis.extent == 1 and isinstance(i, Const) and i.value == 0)
                    for i, axis in zip(value.indices, out.axes)))


def in_place_input(graph, step: int, last_read: dict[int, int], aliased: set[int]) -> int | None:
    """The position of the input of `node` (`graph.nodes[step]`) whose buffer its output may
    take, or None. It may where `node` is a plain node (not a fused group) of an operator
    declaring `Traits.in_place`, whose one output has that argument's shape, dtype and device;
    its task loads the argument only at the output's own index (`loads_own_elements`); and the
    argument is an intermediate of `graph` (computed by a node, not by a store into an input;
    not a graph output) that `node` reads once, that no node after `node` reads (`last_read`:
    by tensor id, the position in `graph.nodes` of the last node reading it) and whose memory
    no view shares (`aliased`: the ids of the tensors that are views or have views). Which
    memory is that argument's is the compiled graph's business: `compile_graph` also declines
    an argument whose slot is an input's or a constant's."""
    node = graph.nodes[step]
    name = node.definition.traits.in_place if type(node) is Operator else None
    if name is None or len(node.outputs) != 1:
        return None
    position = next((k for k, spec in enumerate(node.task.inputs) if spec.name == name), None)
    if position is None or position >= len(node.inputs):
        return None
    t, out = node.inputs[position], node.outputs[0]
    if (tuple(t.shape) != tuple(out.shape) or t.dtype != out.dtype or t.device != out.device
            or t.trace is None or t.trace[1] in stored_into(t.trace[0])):
        return None
    if (last_read[id(t)] != step or id(t) in aliased or sum(x is t for x in node.inputs) != 1
            or any(x is t for x in graph.outputs)):
        return None
    return position if loads_own_elements(node.task, position) else None


def loads_own_elements(task, position: int, output: int = 0) -> bool:
    """Whether `task`'s output `output`, a compute, loads its input at `position` only at its own
    element (`x[p]` for output element p: in the output's value, or in a compute of the same
    shape that it reads, directly or through others, only at its own element), and no compute
    that another output reads loads that input: element p of the result may then overwrite the
    input's element p."""
    out, x = task.outputs[output], task.inputs[position]
    if not isinstance(out, Compute):
        return False
    reads = _reads(out)
    own = {id(out)}
    grown = True
    while grown:        # the computes read only at their readers' own elements, from `out` down
        grown = False
        readers: dict[int, list] = {}
        for reader, load in reads:
            if isinstance(load.tensor, Compute) and id(load.tensor) not in own:
                readers.setdefault(id(load.tensor), []).append((reader, load))
        for key, found in readers.items():
            if all(id(reader) in own and _at_own_index(load, reader)
                   and tuple(load.tensor.shape) == tuple(reader.shape) for reader, load in found):
                own.add(key)
                grown = True
    if not all(id(reader) in own and _at_own_index(load, reader) for reader, load in reads if load.tensor is x):
        return False
    return not any(load.tensor is x for k, t in enumerate(task.outputs) if k != output for _, load in _reads(t))


def _reads(root) -> list[tuple[Compute, Load]]:
    """Every load in `root` (a compute) and in the computes it reads, directly or through
    others, with the compute whose value holds it."""
    found, stack, seen = [], [root], set()
    while stack:
        node = stack.pop()
        if id(node) in seen or not isinstance(node, Compute):
            continue
        seen.add(id(node))
        for e in walk(node.value):
            if isinstance(e, Load):
                found.append((node, e))
                stack.append(e.tensor)
    return found


def _at_own_index(load: Load, reader: Compute) -> bool:
    """Whether `load`, in `reader`'s value, reads at `reader`'s own index."""
    return len(load.indices) == len(reader.axes) and all(i is axis for i, axis in zip(load.indices, reader.axes))


def build_kernels(graph, workers: int | None = None, settings=None) -> list:
    """The built kernel of each node of `graph` (a FlowGraph), in node order, built by `workers`
    threads (ThreadPoolExecutor's default number when None) with `settings`
    (`kiln.settings.Settings`: those in effect when None); a view's (`is_view`) runs nothing."""
    views = {id(node) for node in graph.nodes if is_view(node, graph)}
    tasks = {(id(node.task), node.device): node.task for node in graph.nodes if id(node) not in views}
    with ThreadPoolExecutor(max_workers=workers) as pool:
        # each build in a copy of the caller's context, which holds the compile's record (kiln.log)
        built = {key: pool.submit(contextvars.copy_context().run, compiled_task, task, key[1], settings)
                 for key, task in tasks.items()}
    return [DeviceKernel(node.device, ViewKernel()) if id(node) in views
            else built[(id(node.task), node.device)].result() for node in graph.nodes]


def compile_graph(graph, settings=None) -> CompiledGraph:
    """`graph` (a FlowGraph: `FlowGraph.compile` calls this) as a CompiledGraph: its inputs,
    constants, outputs and intermediates as buffer slots, its nodes as steps in order
    (`graph_slots`), its kernels built with `settings` (see `build_kernels`); its `plan` says
    all that as data."""
    steps, buffers, inputs, outputs, constants = graph_slots(graph)
    kernels = build_kernels(graph, settings=settings)
    plan = Plan([(k.program, k.device) for k in kernels], steps, buffers, inputs, outputs, constants)
    return plan.assemble(kernels)


def graph_slots(graph) -> tuple[list, list[Buffer], list[int], list[int], dict]:
    """The buffer slots of `graph`'s tensors, without building anything: each node's (input
    slots, output slots) in order, the slots' `Buffer`s, the input slots, the output slots and
    the constants by slot."""
    slots: dict[int, int] = {}
    buffers: list[Buffer] = []
    constants = {}

    def new_slot(t: Tensor) -> int:
        slots[id(t)] = len(buffers)
        buffers.append(Buffer(tuple(map(as_dim, t.shape)), t.dtype.torch_dtype, t.device.torch()))
        return slots[id(t)]

    def existing(t: Tensor) -> int:
        """The slot of an input, a constant or an earlier node's output."""
        if id(t) not in slots:
            if t.is_symbolic:
                raise ValueError(f"the graph uses a symbolic tensor {t.signature()} that is neither "
                                 f"one of its inputs nor computed by one of its nodes")
            constants[new_slot(t)] = t.torch()
        return slots[id(t)]

    inputs = [new_slot(t) for t in graph.inputs]
    steps = []
    # for `in_place_input`: the last node reading each tensor, and the tensors whose memory a
    # view shares
    last_read = {id(t): k for k, node in enumerate(graph.nodes) for t in node.inputs}
    aliased = {id(t) for node in graph.nodes if is_view(node, graph) for t in (*node.inputs, *node.outputs)}
    for k, node in enumerate(graph.nodes):
        ins = tuple(existing(t) for t in node.inputs)
        updated = in_place_input(graph, k, last_read, aliased)
        if updated is not None and ins[updated] not in inputs and ins[updated] not in constants:
            # the output updates its argument's buffer (Traits.in_place)
            slots[id(node.outputs[0])] = ins[updated]
            steps.append((ins, (ins[updated],)))
        elif stored_into(node):
            # in-place updates (kiln.passes.in_place): those outputs are their inputs' buffers
            into = stored_into(node)
            if not {ins[p] for p in into.values()} <= set(inputs):
                raise ValueError("an in-place update stores into a tensor that is not an input of the graph")
            slots.update((id(node.outputs[j]), ins[p]) for j, p in into.items())
            steps.append((ins, tuple(ins[into[j]] if j in into else new_slot(t) for j, t in enumerate(node.outputs))))
        else:
            steps.append((ins, tuple(new_slot(t) for t in node.outputs)))
    outputs = [existing(t) for t in graph.outputs]
    return steps, buffers, inputs, outputs, constants
