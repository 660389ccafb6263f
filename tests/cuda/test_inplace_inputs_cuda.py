"""Graphs that change their inputs in place, replayed as CUDA graphs captured on the caller's
tensors (the write-back inside the graph): every call changes the caller's tensor exactly once,
new memory captures again, and inputs that cannot be captured so still give eager's values."""
import gc

import pytest
import torch

import kiln
from kiln.frontend.torch.backend import CompiledRun, KilnFunction

pytestmark = pytest.mark.cuda


def _runs(fn) -> list[CompiledRun]:
    gc.collect()        # graphs of earlier tests, freed with the autograd graphs that held them
    return [run for f in KilnFunction.live() for run in f.graphs.values()]


def _step(a, b):
    a.add_(b)
    return a * 2


def test_each_call_changes_the_input_once():
    torch._dynamo.reset()
    f = torch.compile(_step, backend="kiln")
    a, b = torch.randn(33, 65, device="cuda"), torch.randn(33, 65, device="cuda")
    want = a.clone()
    for _ in range(3):
        got = f(a, b)
        want.add_(b)
        torch.testing.assert_close(a, want)
        torch.testing.assert_close(got, want * 2)
    (run,) = [r for r in _runs(f) if r.captures is not None]
    # each call's output is alive during the next: the first two captures lend them in turn
    assert len(run.captures) == CompiledRun.LENDING_CAPTURES + 1, "the same tensor replays the first call's captures"


def test_new_memory_captures_again_and_old_memory_still_replays():
    torch._dynamo.reset()
    f = torch.compile(_step, backend="kiln")
    tensors = [torch.randn(8, 40, device="cuda") for _ in range(CompiledRun.CAPTURES_KEPT + 2)]
    wants = [t.clone() for t in tensors]
    b = torch.randn(8, 40, device="cuda")
    for round in range(2):
        for t, want in zip(tensors, wants):
            got = f(t, b)
            want.add_(b)
            torch.testing.assert_close(t, want)
            torch.testing.assert_close(got, want * 2)
    (run,) = [r for r in _runs(f) if r.captures is not None]
    assert len(run.captures) == CompiledRun.CAPTURES_KEPT


def test_a_non_contiguous_input_changed_in_place_runs_without_a_graph():
    torch._dynamo.reset()
    f = torch.compile(_step, backend="kiln", dynamic=False)
    base = torch.randn(40, 24, device="cuda")
    b = torch.randn(24, 40, device="cuda")
    a = base.t()
    want = a.clone() + b
    got = f(a, b)
    torch.testing.assert_close(a, want)
    torch.testing.assert_close(got, want * 2)


def test_a_static_cache_written_at_a_position_per_step():
    """The decoding pattern: a cache buffer updated at `position` (a tensor) each call, read
    whole by the step."""
    def step(cache, new, position):
        cache.index_copy_(1, position, new)
        return (cache * new.mean()).sum(1)

    torch._dynamo.reset()
    f = torch.compile(step, backend="kiln")
    cache = torch.randn(2, 16, 8, device="cuda")
    want_cache = cache.clone()
    for k in range(5):
        new = torch.randn(2, 1, 8, device="cuda")
        position = torch.tensor([k * 3], device="cuda")
        got = f(cache, new, position)
        want = step(want_cache, new, position)
        torch.testing.assert_close(cache, want_cache)
        torch.testing.assert_close(got, want)


def test_the_first_call_applies_its_change_once_with_graphs_off_too():
    kiln.torch.dynamo_config.use_cuda_graph(False)
    try:
        torch._dynamo.reset()
        f = torch.compile(_step, backend="kiln")
        a, b = torch.randn(5, 7, device="cuda"), torch.randn(5, 7, device="cuda")
        want = a + b
        f(a, b)
        torch.testing.assert_close(a, want)
    finally:
        kiln.torch.dynamo_config.reset()
