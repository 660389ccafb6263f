"""Greedy decoding of a Llama-style model: eager PyTorch, torch.compile's default backend and Kiln.

The model of `models_bench.llama_1b`'s configuration (8 layers, hidden 2048, 32 heads, 8 KV
heads, vocabulary 32000; random weights, bfloat16 by default) decodes `--tokens` tokens greedily
after a `--prompt`-token prompt, over transformers' StaticCache (the KV cache updated in place at
`cache_position`, so every step has the same shapes and one compiled graph serves them all).
The prompt runs eagerly; each backend compiles the one-token step. Reported: milliseconds per
generated token (the whole loop, host included, divided by the tokens, after a warm-up loop),
the compile time (the warm-up loop's first step), and how many of the tokens equal eager's.
Inductor is timed in its default mode and in mode="reduce-overhead" (CUDA graphs).

    python benchmarks/decode_bench.py [--tokens 256] [--prompt 32] [--dtype bfloat16] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import time
import warnings

import torch


def llama(dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                         attn_implementation="sdpa")
    return config, LlamaForCausalLM(config).to("cuda", dtype).eval()


def decode(model, step, config, prompt, tokens: int, dtype) -> tuple[list[int], float, float]:
    """(tokens, seconds of the first step, seconds of the whole loop)."""
    from transformers import StaticCache
    cache = StaticCache(config=config, max_batch_size=1, max_cache_len=prompt.shape[1] + tokens,
                        dtype=dtype, device="cuda")
    n = prompt.shape[1]
    logits = model(prompt, past_key_values=cache, cache_position=torch.arange(n, device="cuda")).logits
    token = logits[:, -1:].argmax(-1)
    out = []
    torch.cuda.synchronize()
    start = time.perf_counter()
    first = None
    for i in range(tokens):
        out.append(token)
        logits = step(token, past_key_values=cache,
                      cache_position=torch.tensor([n + i], device="cuda")).logits
        token = logits[:, -1:].argmax(-1)
        if first is None:
            torch.cuda.synchronize()
            first = time.perf_counter() - start
    torch.cuda.synchronize()
    return [t.item() for t in out], first, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--json", help="write the rows to this file")
    args = parser.parse_args()
    warnings.simplefilter("ignore", FutureWarning)
    torch.backends.cuda.matmul.allow_tf32 = False
    dtype = getattr(torch, args.dtype)
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    torch.manual_seed(0)
    config, model = llama(dtype)
    prompt = torch.randint(0, config.vocab_size, (1, args.prompt), device="cuda")
    rows = []
    with torch.no_grad():
        reference = None
        for label, backend, mode in (("eager", None, None), ("inductor", "inductor", None),
                                     ("inductor_cg", "inductor", "reduce-overhead"), ("kiln", "kiln", None)):
            torch._dynamo.reset()
            step = model if backend is None else torch.compile(model, backend=backend, mode=mode)
            try:
                _, compile_s, _ = decode(model, step, config, prompt, args.tokens, dtype)   # warm-up
                tokens, _, seconds = decode(model, step, config, prompt, args.tokens, dtype)
            except Exception as exc:   # report the failure and go on
                print(f"{label:<12} FAILED: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                rows.append({"backend": label, "error": f"{type(exc).__name__}: {exc}"})
                continue
            reference = reference or tokens
            same = sum(a == b for a, b in zip(tokens, reference))
            row = {"backend": label, "ms_per_token": seconds / args.tokens * 1e3,
                   "first_step_s": compile_s, "tokens_equal_to_eager": same, "tokens": args.tokens}
            rows.append(row)
            print(f"{label:<12} {row['ms_per_token']:8.3f} ms/token   first step {compile_s:7.2f} s   "
                  f"{same}/{args.tokens} tokens equal to eager's", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "dtype": args.dtype, "prompt": args.prompt,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
