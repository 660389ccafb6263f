"""Inputs updated at a few positions are updated in place (issue 31, `kiln.passes.in_place`): a
decoding step that writes new rows into a static KV cache (`index_copy_` at a position
tensor) stores just those rows into the caller's cache, the attention reads the cache's own
memory, and no copy of the cache is written back; where something reads the old value after
the write, the update stays out of place. Every case ends with eager's outputs and eager's
cache contents. The same cases run on a GPU in tests/cuda/test_in_place_updates_cuda.py."""
from __future__ import annotations

import warnings

import pytest
import torch

import kiln
from kiln.graph.in_place import is_store
from kiln.passes import PassContext
from tests.frontend.in_place_support import (bytes_written, cache_step, decode, in_place_outputs, new_runs, row_nodes,
                                             runs, store_launches, store_nodes, stores, tiny_llama, two_cache_step)

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

DEVICE = "cpu"


def _decode_cache_steps(device, steps=6, dtype=torch.float32):
    """(the run, the cache) of `cache_step` compiled, checked against eager at every step."""
    torch.manual_seed(0)
    before = {id(r) for r in runs()}
    f = torch.compile(cache_step, backend="kiln")
    cache = torch.randn(2, 64, 32, device=device, dtype=dtype)
    want = cache.clone()
    w = torch.randn(32, device=device, dtype=dtype)
    address = cache.data_ptr()
    for k in range(steps):
        new = torch.randn(2, 1, 32, device=device, dtype=dtype)
        position = torch.tensor([3 * k + 1], device=device)
        got = f(cache, new, position, w)
        expected = cache_step(want, new, position, w)
        torch.testing.assert_close(got, expected)
        torch.testing.assert_close(cache, want, rtol=0, atol=0)
    assert cache.data_ptr() == address
    (run,) = new_runs(before)
    return run, cache


def test_a_cache_written_at_a_position_is_updated_in_place():
    run, cache = _decode_cache_steps(DEVICE)
    assert len(stores(run)) == 1
    assert in_place_outputs(run) == [len(run.compiled.outputs) - 1]
    # a call writes the new rows, the small values after them, and nothing of the cache's size
    assert bytes_written(run) < cache.nbytes // 4
    assert not any(run.compiled.buffers[s].nbytes >= cache.nbytes for step in run.compiled.steps
                   for s in step.outputs if s not in run.compiled.inputs)


def test_the_written_back_output_is_the_callers_tensor():
    """The compiled graph returns the caller's cache itself as the written-back value: the
    copy back is skipped, not made onto itself."""
    run, cache = _decode_cache_steps(DEVICE, steps=1)
    compiled = run.compiled
    inputs = [torch.zeros(b.shape, dtype=b.dtype) for b in (compiled.buffers[s] for s in compiled.inputs)]
    outs = compiled.run(inputs)
    assert outs[-1] is inputs[compiled.inputs.index(compiled.outputs[-1])]


def test_the_pass_disabled_gives_the_same_values_out_of_place():
    with PassContext(disabled_passes={"update_in_place"}):
        run, _ = _decode_cache_steps(DEVICE, steps=3)
    assert not stores(run) and not in_place_outputs(run)


def test_keys_and_values_written_at_a_position_then_attended_to():
    torch.manual_seed(1)
    before = {id(r) for r in runs()}
    f = torch.compile(two_cache_step, backend="kiln")
    k, v = torch.randn(1, 2, 24, 8, device=DEVICE), torch.randn(1, 2, 24, 8, device=DEVICE)
    wk, wv = k.clone(), v.clone()
    for step in range(5):
        new_k, new_v = torch.randn(1, 2, 1, 8, device=DEVICE), torch.randn(1, 2, 1, 8, device=DEVICE)
        q = torch.randn(1, 2, 1, 8, device=DEVICE)
        position = torch.tensor([20 - step], device=DEVICE)
        torch.testing.assert_close(f(k, v, new_k, new_v, position, q),
                                   two_cache_step(wk, wv, new_k, new_v, position, q))
        torch.testing.assert_close(k, wk, rtol=0, atol=0)
        torch.testing.assert_close(v, wv, rtol=0, atol=0)
    (run,) = new_runs(before)
    assert len(stores(run)) == 2 and len(in_place_outputs(run)) == 2
    assert len(store_nodes(run)) == 1, "the two updates store in one launch"
    assert len(row_nodes(run)) == 1, "the two updates' rows and offsets come from one kernel"
    assert store_nodes(run) == row_nodes(run) and not store_launches(run), "the kernel computing the rows stores them"


@pytest.mark.slow
def test_greedy_decoding_over_a_static_cache_updates_every_layer_in_place():
    """transformers' StaticCache under a tiny Llama: each layer's keys and values are stored
    in place, the logits of every step and the caches' contents are eager's."""
    config, model = tiny_llama(layers=2, device=DEVICE)
    prompt = torch.randint(0, config.vocab_size, (1, 5), device=DEVICE)
    want, want_cache = decode(model, config, model, prompt, steps=8, device=DEVICE)
    before = {id(r) for r in runs()}
    got, got_cache = decode(model, config, torch.compile(model.forward, backend="kiln"), prompt, steps=8,
                            device=DEVICE)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    for a, b in zip(got_cache.layers, want_cache.layers):
        torch.testing.assert_close(a.keys, b.keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a.values, b.values, rtol=1e-5, atol=1e-5)
    decoding = [r for r in new_runs(before) if stores(r)]
    assert len(decoding) == 1
    (run,) = decoding
    assert len(stores(run)) == 2 * config.num_hidden_layers
    assert len(store_nodes(run)) == config.num_hidden_layers, "a layer's keys and values store in one launch"
    assert len(row_nodes(run)) == config.num_hidden_layers, "a layer's rows and offsets come from one kernel"
    assert store_nodes(run) == row_nodes(run) and not store_launches(run), "the kernel computing the rows stores them"
    cache_bytes = got_cache.layers[0].keys.nbytes
    # each layer's keys, values and step counter (`kiln.passes.in_place_elements`): nothing written back
    assert len(in_place_outputs(run)) == len(run.writeback) == 3 * config.num_hidden_layers
    assert not any(run.compiled.buffers[s].nbytes >= cache_bytes for step in run.compiled.steps
                   for s in step.outputs if s not in run.compiled.inputs)


def _hazard_old_value_read_after(cache, new, position):
    old = cache.clone()
    cache.index_copy_(1, position, new)
    return (cache.sum(1) * old.sum(1)) + old[:, 0]


def _hazard_old_value_returned(cache, new, position):
    old = cache.clone()
    cache.index_copy_(1, position, new)
    return old, cache.sum(1)


def _source_reads_the_cache(cache, new, position):
    cache.index_copy_(1, position, cache[:, :1] * 2 + new)
    return cache.sum(1)


def _updated_twice(cache, new, position):
    cache.index_copy_(1, position, new)
    cache.index_copy_(1, position + 1, new * 3)
    return cache.sum(1)


def _index_put(cache, new, position):
    cache.index_put_((position % 3,), new[0])
    return cache.sum(1)


def _old_value_viewed(cache, new, position):
    old = cache.clone().reshape(-1)
    cache.index_copy_(1, position, new)
    return cache.sum(1).reshape(-1) * old[:15].sum(), old.reshape(3, 60)


def _returns_the_cache(cache, new, position):
    return cache.index_copy_(1, position, new), cache.sum(1)


def _setitem(cache, new, position):
    cache[:, position] = new
    return cache.sum(1)


@pytest.mark.parametrize("fn", [_hazard_old_value_read_after, _hazard_old_value_returned, _source_reads_the_cache,
                                _updated_twice, _index_put, _setitem, _returns_the_cache,
                                _old_value_viewed])
def test_eager_values_whatever_reads_the_cache(fn):
    """Reads of the old value after the write (which keep the update out of place, or order
    the store after them), a source computed from the cache itself, two updates of one cache,
    index_put_ and indexed assignment: outputs and cache are eager's at each call."""
    torch.manual_seed(2)
    f = torch.compile(fn, backend="kiln")
    cache = torch.randn(3, 12, 5, device=DEVICE)
    want = cache.clone()
    for k in range(4):
        new = torch.randn(3, 1, 5, device=DEVICE) if fn is not _index_put else torch.randn(1, 12, 5, device=DEVICE)
        position = torch.tensor([k + 2], device=DEVICE)
        got, expected = f(cache, new, position), fn(want, new, position)
        torch.testing.assert_close(got, expected)
        torch.testing.assert_close(cache, want, rtol=0, atol=0)


def test_a_read_of_the_old_value_after_the_write_keeps_the_update_out_of_place():
    before = {id(r) for r in runs()}
    f = torch.compile(_hazard_old_value_returned, backend="kiln")
    cache = torch.randn(3, 12, 5, device=DEVICE)
    want = cache.clone()
    new, position = torch.randn(3, 1, 5, device=DEVICE), torch.tensor([4], device=DEVICE)
    old, total = f(cache, new, position)
    want_old, want_total = _hazard_old_value_returned(want, new, position)
    torch.testing.assert_close(old, want_old)
    torch.testing.assert_close(cache, want)
    (run,) = new_runs(before)
    assert not stores(run)


def test_a_non_contiguous_cache_gets_eager_values():
    """A cache the caller passes transposed is made contiguous for the run, as every input:
    the store goes into that copy, which is written back."""
    torch.manual_seed(3)
    f = torch.compile(cache_step, backend="kiln", dynamic=False)
    base = torch.randn(16, 40, 2, device=DEVICE)
    cache = base.permute(2, 1, 0)
    assert not cache.is_contiguous()
    want = cache.clone()
    w = torch.randn(16, device=DEVICE)
    for k in range(3):
        new, position = torch.randn(2, 1, 16, device=DEVICE), torch.tensor([k * 5], device=DEVICE)
        torch.testing.assert_close(f(cache, new, position, w), cache_step(want, new, position, w))
        torch.testing.assert_close(cache, want, rtol=0, atol=0)


def test_a_position_out_of_range_fails_and_leaves_the_cache_alone():
    f = torch.compile(cache_step, backend="kiln")
    cache = torch.randn(2, 40, 16, device=DEVICE)
    w = torch.randn(16, device=DEVICE)
    f(cache, torch.randn(2, 1, 16), torch.tensor([0]), w)
    kept = cache.clone()
    with pytest.raises(IndexError):
        f(cache, torch.randn(2, 1, 16), torch.tensor([40]), w)
    torch.testing.assert_close(cache, kept, rtol=0, atol=0)


def test_the_store_compiles_with_nvrtc_for_each_element_size():
    """The CUDA store (kiln.schedule.store_rows) of 1-, 2-, 4- and 8-byte elements, and of two
    updates of other element sizes in one launch, builds for sm_80 and sm_90 (no GPU needed)."""
    from kiln.graph.in_place import store_rows
    from kiln.runtime import cuda as rt
    from kiln.schedule.store_rows import store_program
    from kiln.tensor import symbol
    if not rt.nvrtc_available():
        pytest.skip("NVRTC is not installed")
    jobs = []
    for dtype in (torch.bool, torch.bfloat16, torch.float32, torch.int64):
        x = symbol((2, 8, 4), dtype, "cpu")
        node = store_rows([x], [symbol((2, 1, 4), dtype, "cpu")], [symbol((2, 1, 4), torch.int64, "cpu")]).trace[0]
        assert is_store(node)
        program = store_program(node.task, "cuda")
        jobs += [(rt.launch_source(program, arch), f"store_{dtype}", arch) for arch in ("sm_80", "sm_90")]
    # one launch storing two updates of other element sizes (a step's K and V caches)
    xs = [symbol((2, 8, 4), torch.bfloat16, "cpu"), symbol((3, 5), torch.int64, "cpu")]
    rows = [symbol((2, 1, 4), torch.bfloat16, "cpu"), symbol((3, 2), torch.int64, "cpu")]
    wheres = [symbol((2, 1, 4), torch.int64, "cpu"), symbol((3, 2), torch.int64, "cpu")]
    node = store_rows(xs, rows, wheres)[0].trace[0]
    assert is_store(node) and len(node.outputs) == 2
    program = store_program(node.task, "cuda")
    jobs += [(rt.launch_source(program, arch), "store_two", arch) for arch in ("sm_80", "sm_90")]
    rt.compile_many(jobs, workers=2)


def test_the_graph_cache_keeps_the_in_place_plan(tmp_path, monkeypatch):
    """A plan with in-place stores, stored by the whole-graph cache and loaded by a later
    compile, still updates the caller's cache in place with eager's values."""
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("KILN_GRAPH_CACHE", "1")
    kiln.torch.dynamo_config.graph_cache(True)
    for attempt in range(2):
        torch._dynamo.reset()
        run, _ = _decode_cache_steps(DEVICE, steps=2)
        assert in_place_outputs(run)


def _update_graph(reads_old_after: bool):
    """x updated at `position` (output 1, written back into input 0), and a value read from the
    update and from x's old value: read by the node that also reads the new value (after the
    store, where the pass must decline), or by a node of its own ordered before the store."""
    from kiln.graph import trace_from
    from kiln.tensor import symbol
    x, position, new = symbol((2, 8, 4)), symbol((1,), "int64"), symbol((2, 1, 4))
    updated = kiln.ops.index_copy(x, 1, position, new)
    if reads_old_after:
        y = kiln.ops.add(updated, x)
    else:
        y = kiln.ops.add(updated, kiln.ops.mul(x, 2.0))
    return trace_from([y, updated], [x, position, new])


@pytest.mark.parametrize("reads_old_after", [True, False])
def test_the_pass_orders_the_store_after_every_read_of_the_old_value(reads_old_after):
    from kiln.passes import UpdateInPlace
    graph = _update_graph(reads_old_after)
    update = UpdateInPlace({1: 0})
    out = update(graph)
    assert update.in_place == ([] if reads_old_after else [1])
    assert any(is_store(n) for n in out.nodes) is not reads_old_after
    x, position, new = torch.randn(2, 8, 4), torch.tensor([5]), torch.randn(2, 1, 4)
    want_x = x.clone().index_copy_(1, position, new)
    want_y = want_x + (x if reads_old_after else x * 2)
    y, value = (t.torch() for t in out.run([x, position, new]))
    torch.testing.assert_close(y, want_y)
    torch.testing.assert_close(value, want_x)


def check_copies_into_the_cache(device, monkeypatch, in_place: bool):
    """Compiling (and on a GPU capturing) a step and running it copy nothing into the
    caller's cache where it is updated in place, and at least once where it is not; the
    cache holds eager's values after each call."""
    torch.manual_seed(5)
    cache = torch.randn(2, 64, 32, device=device)
    want = cache.clone()
    w = torch.randn(32, device=device)
    copied = []
    original = torch.Tensor.copy_

    def copy_(self, src, *args, **kwargs):
        if self.data_ptr() == cache.data_ptr():
            copied.append(tuple(self.shape))
        return original(self, src, *args, **kwargs)

    f = torch.compile(cache_step, backend="kiln")
    with PassContext(disabled_passes=() if in_place else ("update_in_place",)):
        new, position = torch.randn(2, 1, 32, device=device), torch.tensor([3], device=device)
        monkeypatch.setattr(torch.Tensor, "copy_", copy_)
        got = f(cache, new, position, w)
        monkeypatch.undo()
        torch.testing.assert_close(got, cache_step(want, new, position, w))
        for k in range(3):
            new, position = torch.randn(2, 1, 32, device=device), torch.tensor([10 + k], device=device)
            torch.testing.assert_close(f(cache, new, position, w), cache_step(want, new, position, w))
    torch.testing.assert_close(cache, want, rtol=0, atol=0)
    assert (copied == []) is in_place, copied


@pytest.mark.parametrize("in_place", [True, False])
def test_nothing_is_copied_into_the_cache(monkeypatch, in_place):
    check_copies_into_the_cache(DEVICE, monkeypatch, in_place)


def check_generate_with_a_static_cache(device, dtype=torch.float32):
    """transformers' documented recipe (`model.forward` compiled, `generate(...,
    cache_implementation="static")`) gives eager's tokens, its decoding graph storing each
    layer's keys and values in place."""
    config, model = tiny_llama(layers=2, dtype=dtype, device=device)
    prompt = torch.randint(0, config.vocab_size, (1, 6), device=device)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = model.generate(prompt, max_new_tokens=10, do_sample=False, cache_implementation="static")
        before = {id(r) for r in runs()}
        model.forward = torch.compile(model.forward, backend="kiln")
        got = model.generate(prompt, max_new_tokens=10, do_sample=False, cache_implementation="static")
    assert got.tolist() == want.tolist()
    assert [len(stores(r)) for r in new_runs(before) if stores(r)] == [2 * config.num_hidden_layers]


@pytest.mark.slow
def test_generate_with_a_static_cache():
    check_generate_with_a_static_cache(DEVICE)
