"""In-place updates of inputs on a GPU (issue 31, `kiln.passes.in_place`), as
tests/frontend/test_in_place_updates.py checks them on the CPU: a KV cache written at a
position is stored into in place inside the CUDA graph (no write-back copy captured), every
replay leaves eager's values in the caller's cache, and reads of the old value keep eager's
semantics."""
from __future__ import annotations

import pytest
import torch

from kiln.frontend.torch.backend import CompiledRun
from kiln.passes import PassContext
from tests.frontend import test_in_place_updates as cpu
from tests.frontend.in_place_support import (bytes_written, decode, in_place_outputs, new_runs, runs, stores,
                                             tiny_llama, two_cache_step)

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("fresh_dynamo")]

DEVICE = "cuda"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_cache_written_at_a_position_is_updated_in_place(dtype):
    run, cache = cpu._decode_cache_steps(DEVICE, steps=6, dtype=dtype)
    assert len(stores(run)) == 1 and in_place_outputs(run)
    assert bytes_written(run) < cache.nbytes // 4
    # each step's output is alive during the next call: two captures lend them in turn (and a
    # copying one waits for a caller holding both)
    assert run.captures is not None and len(run.captures) == CompiledRun.LENDING_CAPTURES + 1, \
        "no capture beyond the first call's, all on the same cache"


@pytest.mark.parametrize("in_place", [True, False])
def test_the_capture_copies_nothing_into_the_cache(monkeypatch, in_place):
    """Compiling and capturing the step copies nothing into the caller's cache where it is
    updated in place (the out-of-place graph captures one copy back), and replays update it."""
    cpu.check_copies_into_the_cache(DEVICE, monkeypatch, in_place)


def test_keys_and_values_written_at_a_position_then_attended_to():
    torch.manual_seed(1)
    before = {id(r) for r in runs()}
    f = torch.compile(two_cache_step, backend="kiln")
    k, v = torch.randn(1, 2, 64, 64, device=DEVICE), torch.randn(1, 2, 64, 64, device=DEVICE)
    wk, wv = k.clone(), v.clone()
    for step in range(5):
        new_k, new_v = torch.randn(1, 2, 1, 64, device=DEVICE), torch.randn(1, 2, 1, 64, device=DEVICE)
        q = torch.randn(1, 2, 1, 64, device=DEVICE)
        position = torch.tensor([60 - step], device=DEVICE)
        torch.testing.assert_close(f(k, v, new_k, new_v, position, q),
                                   two_cache_step(wk, wv, new_k, new_v, position, q), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(k, wk, rtol=0, atol=0)
        torch.testing.assert_close(v, wv, rtol=0, atol=0)
    (run,) = new_runs(before)
    assert len(stores(run)) == 2 and len(in_place_outputs(run)) == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_decoding_over_a_static_cache_updates_every_layer_in_place(dtype):
    config, model = tiny_llama(layers=2, dtype=dtype, device=DEVICE)
    prompt = torch.randint(0, config.vocab_size, (1, 5), device=DEVICE)
    want, want_cache = decode(model, config, model, prompt, steps=8, dtype=dtype, device=DEVICE)
    before = {id(r) for r in runs()}
    got, got_cache = decode(model, config, torch.compile(model.forward, backend="kiln"), prompt, steps=8,
                            dtype=dtype, device=DEVICE, follow=want)
    tolerance = 1e-3 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(got[0], want[0], rtol=tolerance, atol=tolerance)
    for a, b in zip(got_cache.layers, want_cache.layers):
        torch.testing.assert_close(a.keys[:, :, :6], b.keys[:, :, :6], rtol=tolerance, atol=tolerance)
    (run,) = [r for r in new_runs(before) if stores(r)]
    assert len(stores(run)) == 2 * config.num_hidden_layers
    # each layer's keys, values and step counter (`kiln.passes.in_place_elements`): nothing written back
    assert len(in_place_outputs(run)) == len(run.writeback) == 3 * config.num_hidden_layers


def test_the_pass_disabled_gives_the_same_values_out_of_place():
    with PassContext(disabled_passes={"update_in_place"}):
        run, _ = cpu._decode_cache_steps(DEVICE, steps=3)
    assert not stores(run)


@pytest.mark.parametrize("fn", [cpu._hazard_old_value_read_after, cpu._hazard_old_value_returned,
                                cpu._source_reads_the_cache, cpu._updated_twice, cpu._index_put, cpu._setitem,
                                cpu._returns_the_cache, cpu._old_value_viewed])
def test_eager_values_whatever_reads_the_cache(fn):
    torch.manual_seed(2)
    f = torch.compile(fn, backend="kiln")
    cache = torch.randn(3, 12, 5, device=DEVICE)
    want = cache.clone()
    for k in range(4):
        new = (torch.randn(3, 1, 5, device=DEVICE) if fn is not cpu._index_put
               else torch.randn(1, 12, 5, device=DEVICE))
        position = torch.tensor([k + 2], device=DEVICE)
        got, expected = f(cache, new, position), fn(want, new, position)
        torch.testing.assert_close(got, expected)
        torch.testing.assert_close(cache, want, rtol=0, atol=0)


def test_a_non_contiguous_cache_gets_eager_values():
    torch.manual_seed(3)
    f = torch.compile(cpu.cache_step, backend="kiln", dynamic=False)
    cache = torch.randn(32, 64, 2, device=DEVICE).permute(2, 1, 0)
    want = cache.clone()
    w = torch.randn(32, device=DEVICE)
    for k in range(3):
        new, position = torch.randn(2, 1, 32, device=DEVICE), torch.tensor([k * 5], device=DEVICE)
        torch.testing.assert_close(f(cache, new, position, w), cpu.cache_step(want, new, position, w))
        torch.testing.assert_close(cache, want, rtol=0, atol=0)


def test_new_cache_memory_captures_again():
    """A second cache (new memory) of the same shape captures again; both stay eager's."""
    torch.manual_seed(4)
    f = torch.compile(cpu.cache_step, backend="kiln")
    caches = [torch.randn(2, 64, 32, device=DEVICE) for _ in range(2)]
    wants = [c.clone() for c in caches]
    w = torch.randn(32, device=DEVICE)
    for k in range(3):
        for cache, want in zip(caches, wants):
            new, position = torch.randn(2, 1, 32, device=DEVICE), torch.tensor([k], device=DEVICE)
            torch.testing.assert_close(f(cache, new, position, w), cpu.cache_step(want, new, position, w))
            torch.testing.assert_close(cache, want, rtol=0, atol=0)


def test_generate_with_a_static_cache():
    cpu.check_generate_with_a_static_cache(DEVICE)
