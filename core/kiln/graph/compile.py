"""Compiling a FlowGraph into a `kiln.runtime.compiled_graph.CompiledGraph`.

Every tensor of the graph gets a numbered buffer slot; every node becomes a step calling its
operator's built kernel: a `kiln.runtime.plan.Plan`, which assembles the CompiledGraph (where a
kernel lays out a constant input once, `kiln.runtime.cpu.Preparation`: a weight packed as its
GEMM reads it, the prepared form is computed then and becomes one more constant the step
reads). The kernels are built in parallel threads (gcc and NVRTC builds release the GIL), each
distinct task once.
"""
from __future__ import annotations

import contextvars
from concurrent.futures import ThreadPoolExecutor

from kiln.graph.operator import compiled_task
from kiln.runtime.compiled_graph import Buffer, CompiledGraph
from kiln.runtime.plan import Plan
from kiln.tensor import Tensor


def build_kernels(graph, workers: int | None = None, settings=None) -> list:
    """The built kernel of each node of `graph` (a FlowGraph), in node order, built by `workers`
    threads (ThreadPoolExecutor's default number when None) with `settings`
    (`kiln.settings.Settings`: those in effect when None)."""
    tasks = {(id(node.task), node.device): node.task for node in graph.nodes}
    with ThreadPoolExecutor(max_workers=workers) as pool:
        # each build in a copy of the caller's context, which holds the compile's record (kiln.log)
        built = {key: pool.submit(contextvars.copy_context().run, compiled_task, task, key[1], settings)
                 for key, task in tasks.items()}
    return [built[(id(node.task), node.device)].result() for node in graph.nodes]


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
    steps = [(tuple(existing(t) for t in node.inputs), tuple(new_slot(t) for t in node.outputs))
             for node in graph.nodes]
    outputs = [existing(t) for t in graph.outputs]
    kernels = build_kernels(graph, settings=settings)
    plan = Plan([(k.program, k.device) for k in kernels], steps, buffers, inputs, outputs, constants)
    return plan.assemble(kernels)
