"""Compiling a FlowGraph into a `kiln.runtime.compiled_graph.CompiledGraph`.

Every tensor of the graph gets a numbered buffer slot; every node becomes a step calling its
operator's built kernel: a `kiln.runtime.plan.Plan`, which assembles the CompiledGraph (where a
kernel lays out a constant input once, `kiln.runtime.cpu.Preparation`: a weight packed as its
GEMM reads it, the prepared form is computed then and becomes one more constant the step
reads). A StoreRows node (in-place updates, `kiln.graph.in_place`) writes into its inputs'
buffers: each output takes its input's slot. The kernels are built in parallel threads (gcc and NVRTC builds release the GIL), each
distinct task once.
"""
from __future__ import annotations

import contextvars
from concurrent.futures import ThreadPoolExecutor

from kiln.graph.in_place import is_store
from kiln.graph.operator import Operator, compiled_task
from kiln.ir import Compute, Const, Load
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
    constants, outputs and intermediates as buffer slots, its nodes as steps in order, its
    kernels built with `settings` (see `build_kernels`); its `plan` says all that as data."""
    slots: dict[int, int] = {}
    buffers: list[Buffer] = []
    constants = {}

    def new_slot(t: Tensor) -> int:
        slots[id(t)] = len(buffers)
        buffers.append(Buffer(tuple(map(int, t.shape)), t.dtype.torch_dtype, t.device.torch()))
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
    for node in graph.nodes:
        ins = tuple(existing(t) for t in node.inputs)
        if is_store(node):
            # in-place updates (kiln.passes.in_place): each output is its input's buffer
            stored = ins[:len(node.outputs)]
            if not set(stored) <= set(inputs):
                raise ValueError("an in-place update stores into a tensor that is not an input of the graph")
            slots.update(zip(map(id, node.outputs), stored))
            steps.append((ins, stored))
        else:
            steps.append((ins, tuple(new_slot(t) for t in node.outputs)))
    outputs = [existing(t) for t in graph.outputs]
    kernels = build_kernels(graph, settings=settings)
    plan = Plan([(k.program, k.device) for k in kernels], steps, buffers, inputs, outputs, constants)
    return plan.assemble(kernels)
