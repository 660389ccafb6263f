"""Greedy decoding of Llama- and Qwen2-shaped models: eager PyTorch, Inductor with CUDA graphs
and Kiln, in one process.

Models (random weights, bfloat16 by default): `llama_1b` (8 layers, hidden 2048, 32 heads, 8 KV
heads, vocabulary 32000) and `qwen2_0_5b` (24 layers, hidden 896, 14 heads, 2 KV heads,
vocabulary 151936, tied embeddings). A `--prompt`-token prompt runs eagerly, then each backend
compiles the one-token step and decodes `--tokens` tokens greedily over transformers'
StaticCache, the way `generate()` does: the next position and token stay on the GPU, so the
loop never waits for the host (`cache_position + 1`, `argmax`). Reported per model and batch:
milliseconds per generated token (the median over `--rounds` loops after a warm-up loop, each
loop timed whole, every loop's time kept in the JSON; eager's one loop), the weights' bytes over
that time against the copy bandwidth measured in the same run, the first step's logits against
eager's (relative error), and how many tokens equal eager's. Inductor is timed with
mode="reduce-overhead" (CUDA graphs).

    python benchmarks/decode_bench.py [--models llama_1b qwen2_0_5b] [--batch 1 8] [--tokens 128]
        [--prompt 32] [--dtype bfloat16] [--backends inductor_cg kiln] [--rounds 3] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings

import torch


def llama_1b(dtype):
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                         attn_implementation="sdpa")
    return config, LlamaForCausalLM(config).to("cuda", dtype).eval()


def qwen2_0_5b(dtype):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    config = Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                         tie_word_embeddings=True, max_position_embeddings=4096,
                         attn_implementation="sdpa")
    return config, Qwen2ForCausalLM(config).to("cuda", dtype).eval()


MODELS = {"llama_1b": llama_1b, "qwen2_0_5b": qwen2_0_5b}


def copy_bandwidth(nbytes: int) -> float:
    """Bytes per second of a device-to-device copy of `nbytes`, counting reads and writes."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(20):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 2 * nbytes * 20 / (time.perf_counter() - start)


def decode(model, step, cache, prompt, tokens: int):
    """(tokens generated as a (batch, tokens) list, the first step's logits, seconds of the
    loop), over `cache` emptied first (one cache per model and batch: a new one would be new
    memory, which CUDA graphs capture again)."""
    cache.reset()
    n = prompt.shape[1]
    position = torch.arange(n, device="cuda")
    logits = model(prompt, past_key_values=cache, cache_position=position).logits
    token = logits[:, -1:].argmax(-1)
    position = position[-1:] + 1
    out, first = [], None
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(tokens):
        out.append(token)
        logits = step(token, past_key_values=cache, cache_position=position).logits
        if first is None:
            first = logits.float().clone()
        token = logits[:, -1:].argmax(-1)
        position = position + 1
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return torch.cat(out, 1).tolist(), first, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--backends", nargs="+", default=["inductor_cg", "kiln"], choices=["inductor_cg", "kiln"],
                        help="compiled backends to time (eager always runs: it is the reference)")
    parser.add_argument("--rounds", type=int, default=3, help="timed decoding loops; the median is reported")
    parser.add_argument("--json", help="write the rows to this file")
    args = parser.parse_args()
    from transformers import StaticCache
    warnings.simplefilter("ignore", FutureWarning)
    torch.backends.cuda.matmul.allow_tf32 = False
    dtype = getattr(torch, args.dtype)
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    rows = []
    for name in args.models:
        torch.manual_seed(0)
        config, model = MODELS[name](dtype)
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        bandwidth = copy_bandwidth(weight_bytes)
        for batch in args.batch:
            prompt = torch.randint(0, config.vocab_size, (batch, args.prompt), device="cuda")
            cache = StaticCache(config=config, max_batch_size=batch, max_cache_len=args.prompt + args.tokens + 1,
                                dtype=dtype, device="cuda")
            with torch.no_grad():
                reference, reference_logits = None, None
                backends = [("eager", None, None), ("inductor_cg", "inductor", "reduce-overhead"), ("kiln", "kiln", None)]
                for label, backend, mode in [b for b in backends if b[0] == "eager" or b[0] in args.backends]:
                    torch._dynamo.reset()
                    step = model if backend is None else torch.compile(model, backend=backend, mode=mode)
                    row = {"model": name, "batch": batch, "backend": label}
                    try:
                        start = time.perf_counter()
                        decode(model, step, cache, prompt, 4)                  # compile, warm up
                        row["compile_s"] = time.perf_counter() - start
                        timed = 1 if backend is None else args.rounds     # eager: the reference, timed once
                        rounds = [decode(model, step, cache, prompt, args.tokens) for _ in range(timed)]
                    except Exception as exc:   # report the failure and go on
                        print(f"{name} b{batch} {label:<12} FAILED: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                        rows.append({**row, "error": f"{type(exc).__name__}: {exc}"})
                        continue
                    tokens, first, _ = rounds[0]
                    if reference is None:
                        reference, reference_logits = tokens, first
                    rounds_ms = [seconds / args.tokens * 1e3 for _, _, seconds in rounds]
                    ms = statistics.median(rounds_ms)
                    same = sum(a == b for t, r in zip(tokens, reference) for a, b in zip(t, r))
                    row.update(ms_per_token=ms, ms_per_token_rounds=rounds_ms, weight_bytes=weight_bytes,
                               copy_bandwidth=bandwidth,
                               bandwidth_fraction=weight_bytes / (ms * 1e-3) / bandwidth,
                               first_logits_rel_err=float((first - reference_logits).norm() / reference_logits.norm()),
                               tokens_equal_to_eager=same, tokens=args.tokens * batch)
                    rows.append(row)
                    print(f"{name} b{batch} {label:<12} {ms:8.3f} ms/token  {row['bandwidth_fraction']:6.1%} of copy "
                          f"bandwidth  logits err {row['first_logits_rel_err']:.1e}  {same}/{row['tokens']} tokens "
                          f"equal to eager's  compile {row['compile_s']:.1f} s", flush=True)
        del model
        torch.cuda.empty_cache()
    for row in rows:
        if row["backend"] == "kiln" and "ms_per_token" in row:
            ind = next((r for r in rows if r["backend"] == "inductor_cg" and r["model"] == row["model"]
                        and r["batch"] == row["batch"] and "ms_per_token" in r), None)
            if ind:
                row["vs_inductor_cg"] = row["ms_per_token"] / ind["ms_per_token"]
                print(f"{row['model']} b{row['batch']}: Kiln / Inductor+CG time {row['vs_inductor_cg']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "dtype": args.dtype,
                       "prompt": args.prompt, "tokens": args.tokens, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
