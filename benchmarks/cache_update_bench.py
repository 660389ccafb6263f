"""Decode steps over transformers' StaticCache with the KV cache updated in place by Kiln (issue
31, `kiln.passes.in_place`) against the same steps with the update out of place (the pass
disabled: the new cache computed whole and copied back), in one process, alternated.

A small Llama-shaped model (random weights) decodes greedily from a short prompt; each
variant is compiled by its own torch.compile (the pass context of its first call decides), and
the timed rounds alternate between them, each round `--tokens` steps over a cache emptied
first. Reported: milliseconds per step of each (median over rounds) and their ratio; tokens
and caches are checked equal to eager's first.

    python benchmarks/cache_update_bench.py [--device cpu] [--cache-len 256 2048] [--layers 4]
        [--hidden 256] [--tokens 32] [--rounds 5] [--threads 1] [--dtype float32]
"""
from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch


def model_for(args, dtype):
    import transformers
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                                      num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                                      num_key_value_heads=max(1, args.hidden // 128), vocab_size=1024,
                                      max_position_embeddings=max(args.cache_len) + 8, attn_implementation="sdpa")
    return config, transformers.LlamaForCausalLM(config).to(args.device, dtype).eval()


def sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run(model, step, cache, prompt, tokens: int, device: str):
    """(tokens, seconds of the `tokens` steps) over `cache`, emptied first."""
    cache.reset()
    n = prompt.shape[1]
    position = torch.arange(n, device=device)
    logits = model(prompt, past_key_values=cache, cache_position=position).logits
    token, position = logits[:, -1:].argmax(-1), position[-1:] + 1
    out = []
    sync(device)
    start = time.perf_counter()
    for _ in range(tokens):
        logits = step(token, past_key_values=cache, cache_position=position)
        token = logits.logits[:, -1:].argmax(-1)
        out.append(token)
        position = position + 1
    sync(device)
    return torch.cat(out, 1), time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--cache-len", nargs="+", type=int, default=[256, 2048])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    import transformers
    import kiln
    from kiln.frontend.torch.backend import KilnFunction, kiln_backend
    from kiln.graph.in_place import is_store
    from kiln.passes import PassContext
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")
    dtype = getattr(torch, args.dtype)
    config, model = model_for(args, dtype)
    prompt = torch.randint(0, config.vocab_size, (1, 8), device=args.device)
    print(f"{args.device}, {args.layers} layers, hidden {args.hidden}, {args.dtype}, {args.tokens} steps a round, "
          f"{args.rounds} rounds, {args.threads} thread(s)")
    for cache_len in args.cache_len:
        torch._dynamo.reset()
        kiln.torch.dynamo_config.graph_cache(False)
        variants = {}
        for name, disabled in (("in place", ()), ("out of place", ("update_in_place",))):
            # a backend of its own for each variant, so dynamo keeps a compiled frame for each
            compiled = torch.compile(model.forward, backend=lambda gm, examples: kiln_backend(gm, examples))

            def step(*a, compiled=compiled, disabled=disabled, **k):
                with PassContext(disabled_passes=disabled):
                    return compiled(*a, **k)
            variants[name] = (step, transformers.StaticCache(config=config, max_batch_size=1, max_cache_len=cache_len,
                                                             dtype=dtype, device=args.device))
        with torch.no_grad():
            eager_cache = transformers.StaticCache(config=config, max_batch_size=1, max_cache_len=cache_len,
                                                   dtype=dtype, device=args.device)
            want, _ = run(model, model, eager_cache, prompt, args.tokens, args.device)
            times = {name: [] for name in variants}
            for name, (step, cache) in variants.items():        # compile, and check against eager
                before = {id(r) for f in KilnFunction.live() for r in f.graphs.values()}
                got, _ = run(model, step, cache, prompt, args.tokens, args.device)
                new = [r for f in KilnFunction.live() for r in f.graphs.values() if id(r) not in before]
                stores = sum(is_store(n) for r in new if r.graph is not None for n in r.graph.nodes)
                same = (got == want).float().mean().item()
                layers = zip(cache.layers, eager_cache.layers)
                close = all(torch.allclose(a.keys, b.keys, atol=1e-3, rtol=1e-3) for a, b in layers)
                print(f"  cache {cache_len}: {name}: {stores} in-place stores, tokens equal to eager's {same:.0%}, "
                      f"caches close {close}")
            for _ in range(args.rounds):
                for name, (step, cache) in variants.items():
                    times[name].append(run(model, step, cache, prompt, args.tokens, args.device)[1] / args.tokens)
        mine, theirs = (statistics.median(times[n]) * 1e3 for n in ("in place", "out of place"))
        cache_mb = 2 * args.layers * eager_cache.layers[0].keys.nbytes / 2 ** 20
        print(f"  cache {cache_len} ({cache_mb:.1f} MiB of K and V): in place {mine:.3f} ms/step, "
              f"out of place {theirs:.3f} ms/step, {theirs / mine:.2f}x")


if __name__ == "__main__":
    main()
