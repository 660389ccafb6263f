"""Decoding over transformers' StaticCache with each layer's new keys and values stored by the
kernel computing them (`kiln.passes.row_stores`, issue 31): no StoreRows launch is left, and the
logits and caches of several steps (the caches written at a new position each) are eager's,
and exactly those of the same graph with the StoreRows launches, for Llama- and Qwen2-shaped
models of several layers, in float32 and bfloat16, with head dims that are not powers of two.
tests/cuda/test_store_rows_in_kernels_cuda.py runs the same on a GPU."""
from __future__ import annotations

import pytest
import torch

from kiln.passes import PassContext
from tests.frontend.in_place_support import decode, new_runs, row_nodes, runs, store_launches, store_nodes, stores

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def small_model(family: str, layers: int, head_dim: int, dtype, device="cpu"):
    """(config, model): a Llama or Qwen2 of `layers` layers, 4 heads of `head_dim` (2 K/V heads)."""
    import transformers
    torch.manual_seed(0)
    Config, Model = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                     "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[family]
    config = Config(hidden_size=4 * head_dim, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=96, max_position_embeddings=64, head_dim=head_dim)
    return config, Model(config).to(device, dtype).eval()


def check_decoding(family: str, dtype, head_dim: int, device="cpu", layers: int = 3, steps: int = 5):
    """Steps of a `family` model compiled, fed eager's greedy tokens: logits and caches eager's
    (within `dtype`'s rounding) and exactly those with the StoreRows launches kept; the decoding
    graph stores every layer's keys and values from its rows' kernel. The decoding run."""
    config, model = small_model(family, layers, head_dim, dtype, device)
    prompt = torch.randint(0, config.vocab_size, (1, 5), device=device)
    want, want_cache = decode(model, config, model, prompt, steps, dtype=dtype, device=device)
    with PassContext(disabled_passes={"store_rows_in_kernels"}):
        apart, apart_cache = decode(model, config, torch.compile(model.forward, backend="kiln"), prompt, steps,
                                    dtype=dtype, device=device, follow=want)
    torch._dynamo.reset()
    before = {id(r) for r in runs()}
    got, got_cache = decode(model, config, torch.compile(model.forward, backend="kiln"), prompt, steps,
                            dtype=dtype, device=device, follow=want)
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    for a, b, c in zip(got, want, apart):
        torch.testing.assert_close(a, b, rtol=tolerance, atol=tolerance)
        torch.testing.assert_close(a, c, rtol=0, atol=0)
    for a, b, c in zip(got_cache.layers, want_cache.layers, apart_cache.layers):
        for name in ("keys", "values"):
            torch.testing.assert_close(getattr(a, name), getattr(b, name), rtol=tolerance, atol=tolerance)
            torch.testing.assert_close(getattr(a, name), getattr(c, name), rtol=0, atol=0)
    (run,) = [r for r in new_runs(before) if stores(r)]
    assert len(stores(run)) == 2 * layers
    assert not store_launches(run), "no StoreRows launch: each layer's rows kernel stores them"
    assert store_nodes(run) == row_nodes(run) and len(row_nodes(run)) == layers
    return run


@pytest.mark.parametrize("family, dtype, head_dim", [("llama", torch.float32, 10), ("qwen2", torch.bfloat16, 6)])
def test_decoding_stores_each_layers_rows_in_their_kernel(family, dtype, head_dim):
    check_decoding(family, dtype, head_dim)


@pytest.mark.slow
@pytest.mark.parametrize("family, dtype, head_dim", [("llama", torch.bfloat16, 6), ("qwen2", torch.float32, 10)])
def test_decoding_stores_each_layers_rows_in_their_kernel_more(family, dtype, head_dim):
    check_decoding(family, dtype, head_dim)
