"""Inputs updated element-wise as a whole, written in place on a GPU (issue 31,
`kiln.passes.in_place_elements`), as tests/frontend/test_in_place_elements.py checks them on the
CPU: the counter's kernel writes the caller's tensor inside the CUDA graph (no copy captured),
every replay leaves eager's values; and a Qwen2-shaped decoding step over transformers'
StaticCache (its counters advanced in place, its tiny kernels merged into few launches) gives
eager's logits and caches."""
from __future__ import annotations

import warnings

import pytest
import torch

from kiln.graph.in_place import stored_into
from support import rand
from tests.frontend import test_in_place_elements as cpu
from tests.frontend.in_place_support import element_updates, in_place_outputs, new_runs, runs

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("fresh_dynamo")]

DEVICE = "cuda"


@pytest.mark.parametrize("fn", cpu.CASES)
def test_eager_values_whatever_reads_the_input(fn):
    cpu._run_case(fn, (3, 5, 7), torch.float32, DEVICE, calls=4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
@pytest.mark.parametrize("shape", [(), (7,), (33, 65)])
def test_a_counter_is_advanced_in_place(dtype, shape):
    torch.manual_seed(8)
    before = {id(r) for r in runs()}
    f = torch.compile(cpu.counted_step, backend="kiln")
    counter, x = rand(shape, dtype).to(DEVICE), rand(shape, dtype).to(DEVICE)
    want = counter.clone()
    for _ in range(4):
        torch.testing.assert_close(f(counter, x), cpu.counted_step(want, x))
        torch.testing.assert_close(counter, want, rtol=0, atol=0)
    (run,) = new_runs(before)
    assert run.captures is not None
    assert in_place_outputs(run) == [len(run.compiled.outputs) - 1]


def test_a_cache_layer_writes_nothing_back():
    cpu.check_a_cache_layer_writes_nothing_back(DEVICE)


def two_cache_layers(k0, c0, k1, c1, new):
    return cpu.counted_cache_step(k0, c0, new) + cpu.counted_cache_step(k1, c1, new * 2)


def test_the_counters_of_two_cache_layers_are_one_launch():
    """Two StaticCache layers' steps compiled: their counters advance in one kernel
    (`kiln.passes.horizontal`), in place; values and caches eager's at every replay."""
    torch.manual_seed(11)
    before = {id(r) for r in runs()}
    f = torch.compile(two_cache_layers, backend="kiln")
    args = [torch.randn(2, 9, 4, device=DEVICE), torch.tensor(1, device=DEVICE),
            torch.randn(2, 9, 4, device=DEVICE), torch.tensor(1, device=DEVICE)]
    want = [a.clone() for a in args]
    for _ in range(4):
        new = torch.randn(2, 1, 4, device=DEVICE)
        torch.testing.assert_close(f(*args, new), two_cache_layers(*want, new))
        for a, b in zip(args, want):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    (run,) = new_runs(before)
    assert len(in_place_outputs(run)) == len(run.writeback) == 4
    counters = element_updates(run.graph.nodes)
    assert len(counters) == 1 and len(stored_into(counters[0])) == 2


def _qwen2(layers: int, dtype):
    import transformers
    torch.manual_seed(0)
    config = transformers.Qwen2Config(hidden_size=128, intermediate_size=352, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                                      max_position_embeddings=256, tie_word_embeddings=True)
    return config, transformers.Qwen2ForCausalLM(config).to(DEVICE, dtype).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qwen2_decoding_over_a_static_cache_is_eagers(dtype):
    """benchmarks/decode_bench.py's loop on a small Qwen2: each step's logits, the caches'
    keys and values and their counters are eager's, and nothing is written back."""
    import transformers
    config, model = _qwen2(3, dtype)
    prompt = torch.randint(0, config.vocab_size, (1, 7), device=DEVICE)

    def run(step):
        cache = transformers.StaticCache(config=config, max_batch_size=1, max_cache_len=40, dtype=dtype,
                                         device=DEVICE)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            logits = model(prompt, past_key_values=cache, cache_position=torch.arange(7, device=DEVICE)).logits
            token, out = logits[:, -1:].argmax(-1), []
            for i in range(6):
                logits = step(token, past_key_values=cache, cache_position=torch.tensor([7 + i], device=DEVICE)).logits
                out.append(logits.float().clone())
                token = logits[:, -1:].argmax(-1)
        return out, cache

    want, want_cache = run(model)
    before = {id(r) for r in runs()}
    got, got_cache = run(torch.compile(model, backend="kiln"))
    tolerance = 1e-3 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(got[0], want[0], rtol=tolerance, atol=tolerance)
    for a, b in zip(got_cache.layers, want_cache.layers):
        assert a.cumulative_length.item() == b.cumulative_length.item()
        torch.testing.assert_close(a.keys[:, :, :8], b.keys[:, :, :8], rtol=tolerance, atol=tolerance)
        torch.testing.assert_close(a.values[:, :, :8], b.values[:, :, :8], rtol=tolerance, atol=tolerance)
    (step,) = [r for r in new_runs(before) if r.writeback]
    assert len(in_place_outputs(step)) == len(step.writeback) == 3 * config.num_hidden_layers
    counters = element_updates(step.graph.nodes)
    assert len(counters) == 1, "the layers' counters advance in one launch (kiln.passes.horizontal)"
