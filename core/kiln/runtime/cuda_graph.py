"""CUDA graph capture and replay of a sequence of GPU launches.

`CapturedGraph(fn, example_inputs)` runs `fn` once to build and load every kernel, then
captures one more call into a CUDA graph over static input buffers. `run(inputs)` copies the
inputs into those buffers and replays the graph: one launch for the whole sequence, without
Python or driver overhead per kernel. The outputs are the graph's static buffers, overwritten
by the next replay (clone them to keep them).
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch


class CapturedGraph:
    """A captured CUDA graph of `fn(inputs) -> list of torch tensors`."""

    def __init__(self, fn: Callable[[list[torch.Tensor]], list], example_inputs: Sequence[torch.Tensor],
                 wrap: Callable = lambda t: t):
        self.wrap = wrap
        self.static_inputs = [t.detach().clone() for t in example_inputs]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn(self.static_inputs)          # builds and loads every kernel before capture
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, stream=stream):
                self.static_outputs = list(fn(self.static_inputs))
        torch.cuda.current_stream().wait_stream(stream)

    def run(self, inputs: Sequence[torch.Tensor]) -> list:
        """Copy `inputs` (torch tensors, or objects with `.torch()`) into the graph's buffers,
        replay it, and return its static outputs, each passed through `wrap`."""
        if len(inputs) != len(self.static_inputs):
            raise ValueError(f"the captured graph takes {len(self.static_inputs)} inputs, got {len(inputs)}")
        for dst, src in zip(self.static_inputs, inputs):
            src = src.torch() if hasattr(src, "torch") else src
            if tuple(src.shape) != tuple(dst.shape) or src.dtype != dst.dtype:
                raise ValueError(f"captured graph input expects {dst.dtype}{list(dst.shape)}, got "
                                 f"{src.dtype}{list(src.shape)}")
            dst.copy_(src, non_blocking=True)
        self.graph.replay()
        return [self.wrap(t) for t in self.static_outputs]
