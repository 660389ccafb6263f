"""CUDA graph capture and replay of a sequence of GPU launches.

`CapturedGraph(fn, example_inputs)` runs `fn` once to build and load every kernel, then
captures one more call into a CUDA graph over static input buffers. `run(inputs)` copies the
inputs into those buffers and replays the graph: one launch for the whole sequence, without
Python or driver overhead per kernel. The outputs are the graph's static buffers, overwritten
by the next replay, unless `run(inputs, copy=True)` returns copies of them.

A graph has one set of static buffers, so its replays are serialized: one thread at a time
copies in, replays and copies out, all on the caller's current stream (of the graph's device);
a replay on another stream than the last replay's first makes its stream wait for that one.
"""
from __future__ import annotations

import threading
from typing import Callable, Sequence

import torch


_capturing = threading.Lock()


class CapturedGraph:
    """A captured CUDA graph of `fn(inputs) -> list of torch tensors`. The graph keeps `fn`:
    the buffers it closes over (a workspace) are what the captured kernels read and write."""

    def __init__(self, fn: Callable[[list[torch.Tensor]], list], example_inputs: Sequence[torch.Tensor],
                 wrap: Callable = lambda t: t):
        self.wrap = wrap
        self.fn = fn
        self.static_inputs = [t.detach().clone() for t in example_inputs]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn(self.static_inputs)          # builds and loads every kernel before capture
            self.graph = torch.cuda.CUDAGraph()
            # thread_local: CUDA calls of other threads (eager work, another model's run) stay
            # legal during the capture; one capture at a time in the process
            with _capturing, torch.cuda.graph(self.graph, stream=stream, capture_error_mode="thread_local"):
                self.static_outputs = list(fn(self.static_inputs))
        torch.cuda.current_stream().wait_stream(stream)
        self._last_stream = stream          # the stream of the last work on the static buffers
        self._lock = threading.Lock()

    def run(self, inputs: Sequence[torch.Tensor], copy: bool = False) -> list:
        """Copy `inputs` (torch tensors, or objects with `.torch()`) into the graph's buffers,
        replay it on its device's current stream (after the last replay's work, on whatever stream that
        ran) and return its static outputs (their copies with `copy`, which later replays
        leave alone), each passed through `wrap`."""
        if len(inputs) != len(self.static_inputs):
            raise ValueError(f"the captured graph takes {len(self.static_inputs)} inputs, got {len(inputs)}")
        sources = [src.torch() if hasattr(src, "torch") else src for src in inputs]
        for dst, src in zip(self.static_inputs, sources):
            if src.shape != dst.shape or src.dtype != dst.dtype:
                raise ValueError(f"captured graph input expects {dst.dtype}{list(dst.shape)}, got "
                                 f"{src.dtype}{list(src.shape)}")
        with self._lock:
            stream = torch.cuda.current_stream(self._last_stream.device)
            if stream != self._last_stream:
                stream.wait_stream(self._last_stream)
                self._last_stream = stream
            for dst, src in zip(self.static_inputs, sources):
                dst.copy_(src, non_blocking=True)
            self.graph.replay()
            outputs = [t.clone() if copy else t for t in self.static_outputs]
        return [self.wrap(t) for t in outputs]
