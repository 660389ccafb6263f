"""Runs of one compiled model that overlap in time (threads, CUDA streams) never share a
workspace: every result equals eager's."""
from concurrent.futures import ThreadPoolExecutor

import threading

import pytest
import torch
import transformers
from torch import nn

import kiln
from tests.support import assert_close

THREADS, CALLS = 4, 200


def _mlp(device="cpu"):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(24, 64), nn.GELU(), nn.Linear(64, 64), nn.Tanh(),
                         nn.Linear(64, 8)).eval().to(device)


def _hammer(fn, make_inputs, expected_fn):
    """`fn` called CALLS times from each of THREADS threads on fresh inputs; every result is
    compared with eager's. Returns the number of wrong results."""
    def worker(seed):
        g = torch.Generator().manual_seed(seed)
        wrong = 0
        # grad mode is per thread: the caller's no_grad does not reach the pool's threads, whose
        # calls would otherwise compile the training graph (an fx trace, which patches
        # nn.Module.__call__ for every thread while it runs)
        with torch.no_grad():
            for _ in range(CALLS):
                args = make_inputs(g)
                got, want = fn(*args), expected_fn(*args)
                if not torch.allclose(got, want, atol=1e-4, rtol=1e-4):
                    wrong += 1
        return wrong

    # one OpenMP thread per call: THREADS teams of the machine's width would oversubscribe CI's
    # two cores with spinning threads (minutes per test), and the overlap tested is the calls'
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with ThreadPoolExecutor(THREADS) as pool:
            return sum(pool.map(worker, range(THREADS)))
    finally:
        torch.set_num_threads(threads)


@torch.no_grad()
def test_threads_calling_a_compiled_mlp_all_get_eager_results():
    torch._dynamo.reset()
    model = _mlp()
    compiled = torch.compile(model, backend="kiln")
    x = torch.randn(16, 24)
    assert_close(compiled(x), model(x), atol=1e-4, rtol=1e-4)      # compiled once, up front
    wrong = _hammer(compiled, lambda g: (torch.randn(16, 24, generator=g),), model)
    assert wrong == 0, f"{wrong} of {THREADS * CALLS} concurrent results differ from eager"


@torch.no_grad()
def test_threads_calling_a_compiled_bert_all_get_eager_results():
    torch._dynamo.reset()
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=64,
                                     max_position_embeddings=16)
    model = transformers.BertModel(config).eval()
    compiled = torch.compile(model, backend="kiln")

    def eager(ids):
        return model(input_ids=ids).last_hidden_state

    def run(ids):
        return compiled(input_ids=ids).last_hidden_state

    ids = torch.randint(0, 64, (2, 8))
    assert_close(run(ids), eager(ids), atol=1e-4, rtol=1e-4)
    wrong = _hammer(run, lambda g: (torch.randint(0, 64, (2, 8), generator=g),), eager)
    assert wrong == 0, f"{wrong} of {THREADS * CALLS} concurrent results differ from eager"


def test_overlapping_runs_take_different_workspaces():
    x = kiln.symbol((64, 64), "float32", "cpu")
    y = kiln.ops.tanh(kiln.ops.mul(kiln.ops.exp(x), 0.5))
    compiled = kiln.trace_from(y, [x]).compile()
    key, first = compiled._checkout()
    _, second = compiled._checkout()        # while the first is checked out
    assert first is not second
    compiled._checkin(key, first)
    _, third = compiled._checkout()
    assert third is first                   # returned sets are reused, not reallocated


@pytest.mark.cuda
@torch.no_grad()
def test_cuda_streams_never_share_a_workspace_and_all_results_match():
    x = kiln.symbol((256, 256), "float32", "cuda")
    h = x
    for k in range(6):
        h = kiln.ops.tanh(kiln.ops.add(kiln.ops.mul(h, 1.1), float(k)))
    graph = kiln.trace_from(h, [x])
    compiled = graph.compile()

    def eager(t):
        for k in range(6):
            t = torch.tanh(t * 1.1 + k)
        return t

    streams = [torch.cuda.Stream() for _ in range(THREADS)]
    streams_of: dict[int, set] = {}         # workspace set -> the streams it ran on
    checkout = compiled._checkout

    def recording_checkout():
        key, slots = checkout()
        streams_of.setdefault(id(slots), set()).add(key)
        return key, slots

    compiled._checkout = recording_checkout

    def worker(k):
        wrong = 0
        with torch.cuda.stream(streams[k]):
            for _ in range(CALLS):
                t = torch.randn(256, 256, device="cuda")
                got = graph.run([t])[0].torch()
                if not torch.allclose(got, eager(t), atol=1e-5, rtol=1e-5):
                    wrong += 1
        torch.cuda.synchronize()
        return wrong

    with ThreadPoolExecutor(THREADS) as pool:
        wrong = sum(pool.map(worker, range(THREADS)))
    assert wrong == 0
    assert len(streams_of) >= THREADS
    assert all(len(keys) == 1 for keys in streams_of.values()), "two streams ran on one workspace"


@pytest.mark.cuda
@torch.no_grad()
def test_threads_calling_a_compiled_mlp_on_cuda_with_cuda_graphs(monkeypatch):
    torch._dynamo.reset()
    model = _mlp("cuda")
    compiled = torch.compile(model, backend="kiln")
    x = torch.randn(16, 24, device="cuda")
    assert_close(compiled(x), model(x), atol=1e-4, rtol=1e-4)
    streams = [torch.cuda.Stream() for _ in range(THREADS)]
    # a capture among threads drawing random numbers fails (the xfail below): the first call
    # makes every capture the threads need
    captures, begin = [], torch.cuda.CUDAGraph.capture_begin
    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_begin",
                        lambda self, *a, **kw: (captures.append(1), begin(self, *a, **kw))[1])

    def worker(k):
        wrong = 0
        # grad mode is per thread: without no_grad here dynamo would compile (and capture) again
        # in the workers, which is test_capture_while_another_thread_draws_cuda_random_numbers
        with torch.no_grad(), torch.cuda.stream(streams[k]):
            for _ in range(CALLS):
                t = torch.randn(16, 24, device="cuda")
                if not torch.allclose(compiled(t), model(t), atol=1e-4, rtol=1e-4):
                    wrong += 1
        return wrong

    with ThreadPoolExecutor(THREADS) as pool:
        assert sum(pool.map(worker, range(THREADS))) == 0
    assert not captures, f"{len(captures)} captures while the threads ran"


@pytest.mark.cuda
@pytest.mark.xfail(strict=True, raises=RuntimeError,
                   reason="known limitation: while Kiln captures a CUDA graph (torch.cuda.graph), another "
                          "thread drawing CUDA random numbers fails with PyTorch's 'Offset increment outside "
                          "graph capture encountered unexpectedly' (the capture puts torch's CUDA generator "
                          "in capture mode for every thread); seen on an H200, 2026-11-23")
def test_capture_while_another_thread_draws_cuda_random_numbers(monkeypatch):
    """The other thread draws while a capture is open: every capture is held open until it has."""
    torch._dynamo.reset()
    model = _mlp("cuda")
    compiled = torch.compile(model, backend="kiln")
    capturing, drawn = threading.Event(), threading.Event()
    begin = torch.cuda.CUDAGraph.capture_begin

    def capture_begin(self, *args, **kwargs):
        begin(self, *args, **kwargs)
        capturing.set()
        drawn.wait(timeout=60)

    def draw():
        capturing.wait(timeout=60)
        try:
            torch.randn(1024, device="cuda")
        finally:
            drawn.set()

    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_begin", capture_begin)
    with ThreadPoolExecutor(1) as pool:
        drawing = pool.submit(draw)
        with torch.no_grad():
            for _ in range(3):
                compiled(torch.randn(4, 24, device="cuda"))
        assert capturing.is_set(), "Kiln captured no CUDA graph"
        drawing.result()


@pytest.mark.cuda
def test_cuda_graph_replays_of_a_compiled_model_match_eager():
    torch._dynamo.reset()
    model = _mlp("cuda")
    compiled = torch.compile(model, backend="kiln")
    with torch.no_grad():
        for _ in range(6):
            t = torch.randn(16, 24, device="cuda")
            assert_close(compiled(t), model(t), atol=1e-4, rtol=1e-4)
