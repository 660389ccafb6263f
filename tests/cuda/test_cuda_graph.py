"""CUDA graph capture of a FlowGraph: replays give the plain run's values."""
import weakref

import pytest
import torch

import kiln
from tests.support import assert_close

pytestmark = pytest.mark.cuda


def test_cuda_graph_replay_matches_plain_run():
    x = kiln.symbol((64, 768), "float32", "cuda")
    w = kiln.symbol((768, 256), "float32", "cuda")
    y = kiln.ops.softmax(kiln.ops.add(kiln.ops.matmul(x, w), 1.0), -1)
    graph = kiln.trace_from(y, [x, w])
    captured = graph.cuda_graph()
    for _ in range(2):                      # fresh inputs each replay
        a, b = torch.randn(64, 768, device="cuda"), torch.randn(768, 256, device="cuda") * 0.05
        replayed = captured.run([kiln.from_torch(a), b])[0]
        assert_close(replayed, graph.run([a, b])[0].torch())
        assert_close(replayed, torch.softmax(a @ b + 1.0, -1), atol=1e-4, rtol=1e-4)


def test_replays_on_alternating_streams_are_ordered():
    """A replay on another stream than the last one's waits for it: each call's copy into the
    graph's input buffer comes after the previous replay has read it, with no sync between."""
    x = kiln.symbol((2048, 2048), "float32", "cuda")
    y = kiln.ops.tanh(kiln.ops.matmul(x, x))
    captured = kiln.trace_from(y, [x]).cuda_graph()
    streams = [torch.cuda.Stream() for _ in range(2)]
    inputs = [torch.randn(2048, 2048, device="cuda") * 0.02 for _ in range(6)]
    torch.cuda.synchronize()
    got = []
    for k, a in enumerate(inputs):
        with torch.cuda.stream(streams[k % 2]):
            got.append(captured.run([a], copy=True)[0].torch())
    torch.cuda.synchronize()
    for a, out in zip(inputs, got):
        assert_close(out, torch.tanh(a @ a), atol=1e-4, rtol=1e-4)


def test_an_input_returned_as_is_is_the_callers_tensor():
    """Issue 32: a loss graph saves its input, the logits, for its backward; the capture copied
    them into its static buffer and handed out a copy of that buffer (412 MB for GPT-2 at batch
    8). An output that is an input the graph does not write is now the caller's tensor, where
    it is contiguous; a non-contiguous one is still copied, contiguous as before."""
    x = kiln.symbol((64, 96), "float32", "cuda")
    graph = kiln.trace_from([kiln.ops.exp(x), x], [x])
    captured = graph.cuda_graph()
    for _ in range(2):
        a = torch.randn(64, 96, device="cuda")
        y, same = captured.run([a], copy=True)
        assert same.torch() is a
        assert_close(y, torch.exp(a))
        b = torch.randn(96, 64, device="cuda").t()
        y, copied = captured.run([b], copy=True)
        assert copied.torch() is not b and copied.torch().is_contiguous()
        assert_close(copied, b)
        assert_close(y, torch.exp(b))


def test_a_larger_workspace_frees_the_smaller_one_first():
    """Issue 32: a capture that needed a larger shared workspace allocated it while the graphs
    on the smaller one kept theirs until their next call (GPT-2's training step held 501 and
    616 MB at once). Those graphs are retired first: the smaller workspace is gone before the
    larger one is allocated, a retired graph never replays, and its owner captures anew."""
    x = kiln.symbol((512, 512), "float32", "cuda")
    small_graph = kiln.trace_from(kiln.ops.exp(kiln.ops.matmul(x, x)), [x])
    small = small_graph.cuda_graph()
    a = torch.randn(512, 512, device="cuda") * 0.05
    assert_close(small.run([a], copy=True)[0], torch.exp(a @ a), atol=1e-4, rtol=1e-4)
    old = weakref.ref(small._order)
    y = kiln.symbol((8192, 8192), "float32", "cuda")
    big = kiln.trace_from(kiln.ops.tanh(kiln.ops.matmul(y, y)), [y]).cuda_graph()
    assert old() is None and small.stale() and small.run([a]) is None
    b = torch.randn(8192, 8192, device="cuda") * 0.01
    assert_close(big.run([b], copy=True)[0], torch.tanh(b @ b), atol=1e-4, rtol=1e-4)
    again = small_graph.cuda_graph()
    assert_close(again.run([a], copy=True)[0], torch.exp(a @ a), atol=1e-4, rtol=1e-4)


def test_a_bound_input_returned_is_not_held_by_the_graph():
    """Issue 32: a loss graph reading the logits that the model's capture lends binds them in
    place and returns them (saved for its backward); its capture held the example's tensor as a
    static output, which kept the model's capture busy for good (its outputs were copied from then
    on). The graph keeps no reference to a bound input it returns."""
    x = kiln.symbol((64, 96), "float32", "cuda")
    a = torch.randn(64, 96, device="cuda")
    captured = kiln.trace_from([kiln.ops.exp(x), x], [x]).cuda_graph([a], bound=[0])
    example = weakref.ref(a)
    y, same = captured.run([a], copy=True)
    assert same.torch() is a
    assert_close(y, torch.exp(a))
    del a, same
    assert example() is None


def test_a_first_call_runs_its_graph_once_before_its_three_captures(monkeypatch):
    """Issue 33: a first call (a new sequence length's) captures three CUDA graphs, one copying
    and two lending its outputs. Only the first needs a run before its capture, which loads the
    kernels: four runs in all, not six (a tenth of a GPT-2 first call's 0.1 s on the H200)."""
    from kiln.runtime.compiled_graph import CompiledGraph
    runs = []
    run = CompiledGraph.run

    def counted(self, *args, **kwargs):
        runs.append(self)
        return run(self, *args, **kwargs)
    monkeypatch.setattr(CompiledGraph, "run", counted)
    f = torch.compile(lambda x: torch.tanh(x @ x.t() * 0.1) + 1, backend="kiln")
    x = torch.randn(80, 48, device="cuda")
    assert_close(f(x), (torch.tanh(x.double() @ x.double().t() * 0.1) + 1).float(), atol=1e-3, rtol=1e-3)
    assert len(runs) == 4 and len(set(map(id, runs))) == 1
    for _ in range(3):
        x = torch.randn(80, 48, device="cuda")
        assert_close(f(x), (torch.tanh(x.double() @ x.double().t() * 0.1) + 1).float(), atol=1e-3, rtol=1e-3)
    assert len(runs) == 4
