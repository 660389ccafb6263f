"""CUDA graph capture and replay of a sequence of GPU launches.

`CapturedGraph(fn, example_inputs)` runs `fn` once to build and load every kernel, then
captures one more call into a CUDA graph over static input buffers. `run(inputs)` copies the
inputs into those buffers and replays the graph: one launch for the whole sequence, without
Python or driver overhead per kernel. The outputs are the graph's static buffers, overwritten
by the next replay, unless `run(inputs, copy=True)` returns copies of them.

A graph has one set of static buffers, so its replays are serialized: one thread at a time
copies in, replays and copies out, all on the stream the graph was captured on, which waits
for the caller's current stream and which the caller's stream then waits for.
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
        # replays run on the capture stream, ordered after the caller's stream and before its next work
        self._stream = stream
        self._lock = threading.Lock()

    def run(self, inputs: Sequence[torch.Tensor], copy: bool = False) -> list:
        """Copy `inputs` (torch tensors, or objects with `.torch()`) into the graph's buffers,
        replay it (on the capture stream, after the current stream's work and before its next),
        and return its static outputs (their copies with
        `copy`, which later replays leave alone), each passed through `wrap`."""
        if len(inputs) != len(self.static_inputs):
            raise ValueError(f"the captured graph takes {len(self.static_inputs)} inputs, got {len(inputs)}")
        sources = [src.torch() if hasattr(src, "torch") else src for src in inputs]
        for dst, src in zip(self.static_inputs, sources):
            if tuple(src.shape) != tuple(dst.shape) or src.dtype != dst.dtype:
                raise ValueError(f"captured graph input expects {dst.dtype}{list(dst.shape)}, got "
                                 f"{src.dtype}{list(src.shape)}")
        caller = torch.cuda.current_stream()
        with self._lock:
            self._stream.wait_stream(caller)
            with torch.cuda.stream(self._stream):
                for dst, src in zip(self.static_inputs, sources):
                    dst.copy_(src, non_blocking=True)
                    src.record_stream(self._stream)
                self.graph.replay()
                outputs = [t.clone() if copy else t for t in self.static_outputs]
            caller.wait_stream(self._stream)
        if copy:
            for t in outputs:
                t.record_stream(caller)
        return [self.wrap(t) for t in outputs]
