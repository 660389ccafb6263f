"""transformers' `generate()` with a static cache, the recipe users follow: eager, Kiln and
Inductor with CUDA graphs compiling `model.forward`, in one process, in that order (Inductor's
CUDA graphs crashed the process on the Llama-style 1B under torch 2.11; Kiln's row comes first).
The rows are written to `--json` as each completes.

The models are decode_bench's (random weights, bfloat16 by default; `--models tiny` is a 2-layer
Llama for a check on the CPU). Each backend runs `model.generate(prompt, max_new_tokens=--tokens,
do_sample=False, cache_implementation="static")` once to compile and warm up, then once timed.
Greedy tokens can only be asked to equal eager's while eager's choice is clear: reported are the
steps until eager's top two logits first come within `--margin` (relative to the larger, about
what bfloat16's rounding of the logits moves them), and how many of those steps gave eager's
token; beyond that the tokens may part without either being wrong. Also the milliseconds per
new token of the timed call (prefill included, as users see it).

    python benchmarks/generate_bench.py [--models llama_1b qwen2_0_5b] [--batch 1] [--tokens 64]
        [--prompt 32] [--dtype bfloat16] [--margin 0.0078] [--backends inductor_cg kiln]
        [--device cuda] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import time
import warnings

import torch

from decode_bench import MODELS


def tiny(dtype, device: str = "cpu"):
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, attn_implementation="sdpa")
    return config, LlamaForCausalLM(config).to(device, dtype).eval()


def generate(model, prompt, tokens: int) -> tuple[torch.Tensor, list[torch.Tensor], float]:
    """(the new tokens, each step's logits, seconds) of greedy `generate()` over a static cache."""
    synchronize = torch.cuda.synchronize if prompt.is_cuda else (lambda: None)
    synchronize()
    start = time.perf_counter()
    out = model.generate(prompt, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                         cache_implementation="static", output_logits=True, return_dict_in_generate=True)
    synchronize()
    return out.sequences[:, prompt.shape[1]:], list(out.logits), time.perf_counter() - start


def clear_steps(logits: list[torch.Tensor], margin: float) -> int:
    """The steps before the first where some row's top two logits lie within `margin` of each
    other, relative to the larger magnitude."""
    for k, step in enumerate(logits):
        top = step.float().topk(2, dim=-1).values
        if bool(((top[:, 0] - top[:, 1]) <= margin * top.abs().max(-1).values).any()):
            return k
    return len(logits)


def _own_logits(forward):
    """`forward` (compiled by Inductor with CUDA graphs) handing out its logits as a copy:
    its next replay overwrites the outputs, while generate() still reads the last step's."""
    def call(*args, **kwargs):
        torch.compiler.cudagraph_mark_step_begin()
        out = forward(*args, **kwargs)
        out.logits = out.logits.clone()
        return out
    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=[*MODELS, "tiny"])
    parser.add_argument("--batch", nargs="+", type=int, default=[1])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--margin", type=float, default=2.0 ** -7, help="bfloat16's relative rounding step")
    parser.add_argument("--backends", nargs="+", default=["inductor_cg", "kiln"], choices=["inductor_cg", "kiln"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json", help="write the rows to this file")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    torch.backends.cuda.matmul.allow_tf32 = False
    dtype = getattr(torch, args.dtype)
    rows = []
    for name in args.models:
        for batch in args.batch:
            torch.manual_seed(0)
            config, model = tiny(dtype, args.device) if name == "tiny" else MODELS[name](dtype)
            eager_forward = model.forward
            prompt = torch.randint(0, config.vocab_size, (batch, args.prompt), device=args.device)
            reference = clear = None
            with torch.no_grad():
                for label, backend, mode in [("eager", None, None), ("kiln", "kiln", None),
                                             ("inductor_cg", "inductor", "reduce-overhead")]:
                    if label != "eager" and label not in args.backends:
                        continue
                    torch._dynamo.reset()
                    model.forward = (eager_forward if backend is None else
                                     torch.compile(eager_forward, backend=backend, mode=mode))
                    if mode == "reduce-overhead":
                        model.forward = _own_logits(model.forward)
                    row = {"model": name, "batch": batch, "backend": label}
                    try:
                        generate(model, prompt, args.tokens)                  # compile, warm up
                        tokens, logits, seconds = generate(model, prompt, args.tokens)
                    except Exception as exc:   # report the failure and go on
                        print(f"{name} b{batch} {label:<12} FAILED: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                        rows.append({**row, "error": f"{type(exc).__name__}: {exc}"})
                        _write(args, rows)
                        continue
                    if reference is None:
                        reference, clear = tokens, clear_steps(logits, args.margin)
                    equal = int((tokens[:, :clear] == reference[:, :clear]).all(0).sum())
                    row.update(ms_per_token=seconds / args.tokens * 1e3, clear_steps=clear,
                               equal_in_clear_steps=equal, equal_steps=int((tokens == reference).all(0).sum()),
                               tokens=args.tokens)
                    rows.append(row)
                    print(f"{name} b{batch} {label:<12} {row['ms_per_token']:8.3f} ms/token  tokens equal to eager's "
                          f"in {equal} of {clear} clear steps ({row['equal_steps']} of {args.tokens} in all)", flush=True)
                    _write(args, rows)
            model.forward = eager_forward


def _write(args, rows: list[dict]) -> None:
    """The rows so far, to `--json` (where given)."""
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if args.device == "cuda" else args.device,
                       "torch": torch.__version__, "dtype": args.dtype, "margin": args.margin,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
