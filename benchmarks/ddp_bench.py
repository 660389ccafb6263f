"""Data-parallel training step time on two GPUs: DDP and FSDP2, eager, Inductor and Kiln.

`--model tiny`: the tiny Llama-style model of the data-parallel tests (tests/training/ddp_support.py:
3 layers, hidden 128, 16 tokens); `--model gpt2`: GPT-2 small (transformers, dropout off, 512
tokens). float32 (`--autocast bfloat16`: the forward under autocast), SGD with momentum. Each
trains `--steps` steps on one GPU with the whole global batch (eagerly: the reference losses),
then on two GPUs (NCCL, one process a GPU, half of each global batch each) for each wrapper
(`--wraps`: DistributedDataParallel with buckets of `--bucket-mb`, at which dynamo's DDP
optimizer splits the graph; FSDP2's `fully_shard` per decoder layer) and backend. Reported: the
median step time after three steps (CUDA events on rank 0) and the largest relative difference
between the two-GPU losses and the one-GPU eager losses.

    python benchmarks/ddp_bench.py [--model tiny|gpt2] [--steps 20] [--batch 8]
        [--wraps ddp fsdp2] [--backends eager inductor kiln] [--autocast bfloat16]
        [--bucket-mb 25] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "training"))
from ddp_support import ddp_losses, global_batches, single_process_losses, tiny_llama  # noqa: E402
from training_support import LanguageModel  # noqa: E402


def gpt2_small() -> LanguageModel:
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    config = GPT2Config(use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return LanguageModel(GPT2LMHeadModel(config))


MODELS = {"tiny": (tiny_llama, {}), "gpt2": (gpt2_small, {"vocab": 50257, "length": 512})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", choices=list(MODELS))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    parser.add_argument("--wraps", nargs="+", default=["ddp", "fsdp2"], choices=["ddp", "fsdp2"])
    parser.add_argument("--backends", nargs="+", default=["eager", "inductor", "kiln"])
    parser.add_argument("--autocast", choices=["bfloat16", "float16"], help="run the forward under autocast to this dtype")
    parser.add_argument("--bucket-mb", type=float, default=25, help="DDP's bucket size (DDP's default: 25)")
    parser.add_argument("--json", help="write the results to this file")
    args = parser.parse_args()
    warnings.simplefilter("ignore", FutureWarning)
    torch.backends.cuda.matmul.allow_tf32 = False
    print(f"GPU: {torch.cuda.get_device_name()} x {torch.cuda.device_count()}, torch {torch.__version__}", flush=True)
    make, sizes = MODELS[args.model]
    model, batches = make(), global_batches(args.steps, args.batch, **sizes)
    autocast = getattr(torch, args.autocast) if args.autocast else None
    reference, eager_times = single_process_losses(model, batches, "cuda", backend=None, autocast=autocast)
    result = {"gpu": torch.cuda.get_device_name(), "model": args.model, "steps": args.steps,
              "global_batch": args.batch, "autocast": args.autocast, "bucket_mb": args.bucket_mb, "reference_losses": reference,
              "rows": [{"wrap": "one GPU", "backend": "eager", "step_ms": statistics.median(eager_times[3:])}]}
    report(result, args.json)
    for wrap in args.wraps:
        for backend in args.backends:
            try:
                run = ddp_losses(model, batches, 2, "cuda", backend=None if backend == "eager" else backend,
                                 wrap=wrap, autocast=autocast, bucket_mb=args.bucket_mb)
            except RuntimeError as exc:
                result["rows"].append({"wrap": wrap, "backend": backend, "error": str(exc)})
            else:
                result["rows"].append({"wrap": wrap, "backend": backend, "step_ms": run["step_ms"], "losses": run["losses"],
                                       "max_rel_loss_diff": max(abs(a - b) / abs(b) for a, b in zip(run["losses"], reference))})
            report(result, args.json)


def report(result: dict, path: str | None) -> None:
    """Print the newest row and rewrite the JSON file, so that a run cut short keeps its rows."""
    r = result["rows"][-1]
    if "error" in r:
        print(f"{r['wrap']:<8} {r['backend']:<9} FAILED: {r['error'][-3000:]}", flush=True)
    else:
        diff = f"   loss vs one GPU eager {r['max_rel_loss_diff']:.2e}" if "max_rel_loss_diff" in r else ""
        print(f"{r['wrap']:<8} {r['backend']:<9} {r['step_ms']:8.2f} ms/step{diff}", flush=True)
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
