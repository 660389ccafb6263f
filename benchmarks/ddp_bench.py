"""DistributedDataParallel training step time on two GPUs, compiled by Kiln.

The tiny Llama-style model of the DDP test (tests/training/ddp_support.py: 3 layers, hidden 128,
float32, SGD with momentum, 1 MB buckets, so dynamo's DDP optimizer splits the graph) trains
`--steps` steps on two GPUs (NCCL, one process a GPU, half of each global batch each) and on one
GPU with the whole global batch, eagerly and through Kiln. Reported: the median step time after
three steps (CUDA events on rank 0), and the largest relative difference between the DDP losses
and the one-GPU eager losses.

    python benchmarks/ddp_bench.py [--steps 20] [--batch 8] [--json out.json]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences of 16 tokens)")
    parser.add_argument("--json", help="write the results to this file")
    args = parser.parse_args()
    warnings.simplefilter("ignore", FutureWarning)
    torch.backends.cuda.matmul.allow_tf32 = False
    print(f"GPU: {torch.cuda.get_device_name()} x {torch.cuda.device_count()}, torch {torch.__version__}", flush=True)
    model, batches = tiny_llama(), global_batches(args.steps, args.batch)
    reference, eager_times = single_process_losses(model, batches, "cuda", backend=None)
    torch._dynamo.reset()
    _, kiln_times = single_process_losses(model, batches, "cuda", backend="kiln")
    rows = {"one GPU, eager": statistics.median(eager_times[3:]),
            "one GPU, kiln": statistics.median(kiln_times[3:])}
    result = {"gpu": torch.cuda.get_device_name(), "steps": args.steps, "global_batch": args.batch}
    for backend in ("eager", "kiln"):
        ddp = ddp_losses(model, batches, 2, "cuda", backend=backend)
        rows[f"two GPUs DDP, {backend}"] = ddp["step_ms"]
        result[f"ddp_{backend}_max_rel_diff"] = max(abs(a - b) / abs(b) for a, b in zip(ddp["losses"], reference))
        result[f"ddp_{backend}_losses"] = ddp["losses"]
    result["reference_losses"], result["step_ms"] = reference, rows
    for label, ms in rows.items():
        print(f"{label:<22} {ms:8.2f} ms/step", flush=True)
    for backend in ("eager", "kiln"):
        print(f"DDP {backend}: largest relative loss difference to one GPU eager "
              f"{result[f'ddp_{backend}_max_rel_diff']:.2e}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
