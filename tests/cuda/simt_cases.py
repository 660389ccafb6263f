"""Float32 GEMM tasks for the SIMT template (`matmul_simt`): tile edges, operands of every
layout it copies (float4s along k or along m/n, scalars), batches with broadcasting, linear
with bias, a convolution through the load hooks, and views fused in front of a matmul (a
transposed operand, a slice at an offset). The NVRTC test compiles every knob setting for
them, the GPU test runs them against PyTorch."""
from __future__ import annotations

import torch
import torch.nn.functional as F

import kiln
from kiln.graph import optimize, trace_from
from kiln.plugins.registry import registry
from kiln.tensor import symbol

from tests.support import rand

o = kiln.ops

# name: (operator, inputs' shapes and extra arguments, reference)
CALLS = {
    "square_tiles": ("matmul", [(256, 64), (64, 256)], torch.matmul),
    "odd_k_scalar_a": ("matmul", [(17, 33), (33, 1000)], torch.matmul),
    "odd_everything": ("matmul", [(129, 67), (67, 131)], torch.matmul),
    "batched_broadcast": ("matmul", [(2, 3, 70, 64), (3, 64, 40)], torch.matmul),
    "linear_bias": ("linear", [(5, 7, 96), (50, 96), (50,)], F.linear),
    "conv_hooks": ("conv2d", [(2, 5, 17, 15), (12, 5, 3, 3), (12,), 2, 1], F.conv2d),
}

# name: (inputs' shapes, graph on Kiln symbols, reference on torch tensors)
VIEWS = {
    "transposed_a": ([(70, 36), (70, 52)], lambda x, w: [o.matmul(o.permute(x, (1, 0)), w)],
                     lambda x, w: x.t() @ w),
    "slice_offset": ([(40, 100), (96, 36)], lambda x, w: [o.matmul(o.slice(x, 1, 4, 100), w)],
                     lambda x, w: x[:, 4:] @ w),
    "slice_odd_offset": ([(40, 101), (96, 36)], lambda x, w: [o.matmul(o.slice(x, 1, 5, 101), w)],
                         lambda x, w: x[:, 5:] @ w),
}


def call_inputs(name: str, device: str = "cpu") -> list:
    """Fresh random inputs (and extra arguments) of CALLS[name]."""
    return [rand(s, torch.float32).to(device) if isinstance(s, tuple) else s for s in CALLS[name][1]]


def call_task(name: str, args: list):
    """The task of CALLS[name] on `args`."""
    definition = registry().operator(CALLS[name][0])
    return definition.task(definition.bind([kiln.from_torch(t) if isinstance(t, torch.Tensor) else t for t in args],
                                           {}))[0]


def view_task(name: str):
    """(the matmul task of VIEWS[name] with its views fused in, the positions of its inputs
    among the graph's inputs)."""
    shapes, build, _ = VIEWS[name]
    symbols = [symbol(s, "float32", "cuda") for s in shapes]
    graph = optimize(trace_from(list(build(*symbols)), symbols))
    (node,) = graph.nodes
    positions = {id(t): i for i, t in enumerate(graph.inputs)}
    return node.task, [positions[id(t)] for t in node.inputs]
