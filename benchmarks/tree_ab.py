"""Kiln alone on the model suite, for same-run A/B of two trees: kernels per forward and time.

For each model (float16, random weights, `models_bench`'s cases): the kernels one forward
launches with CUDA graphs off (`kernel_counts.counting_launches`), the largest error against
eager relative to its scale, and the median milliseconds of a forward with CUDA graphs on.
Run it once per tree, each with that tree's Kiln on PYTHONPATH and this checkout's benchmarks
directory for the models; compare the JSON files.

    PYTHONPATH=<tree>/core:<tree>/ops_builtin:... python benchmarks/tree_ab.py LABEL out.json [--models ...]
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from kernel_counts import counting_launches, randomize_batch_norm
from models_bench import CASES, max_error, timed

SUITE = ["resnet50_b32", "resnet18", "mobilenet_v3", "convnext_tiny_b8", "efficientnet_b0_b8", "vit_b16_b8",
         "bert_b8", "gpt2", "llama_1b"]


def measure(name: str) -> dict:
    """Kernels per forward, error against eager and milliseconds of `name` through Kiln."""
    from kiln.frontend.torch import dynamo_config
    torch.manual_seed(0)
    model, make_inputs = CASES[name]()
    randomize_batch_norm(model)
    model = model.to("cuda", torch.float16).eval()
    inputs = tuple(x.cuda() for x in make_inputs(torch.float16))
    with torch.no_grad():
        want = model(*inputs)
        torch._dynamo.reset()
        dynamo_config.use_cuda_graph(False)
        uncaptured = torch.compile(model, backend="kiln")
        start = time.perf_counter()
        uncaptured(*inputs)
        torch.cuda.synchronize()
        compile_s = time.perf_counter() - start
        with counting_launches() as launches:
            got = uncaptured(*inputs)
        torch.cuda.synchronize()
        torch._dynamo.reset()
        dynamo_config.use_cuda_graph(True)
        captured = torch.compile(model, backend="kiln")
        captured(*inputs)
        ms = timed(captured, inputs)
    return {"model": name, "kernels": launches[0], "ms": ms, "rel_err": max_error(got, want),
            "first_compile_s": compile_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("label")
    parser.add_argument("json")
    parser.add_argument("--models", nargs="+", default=SUITE, choices=list(CASES))
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    rows = []
    for name in args.models:
        try:
            row = {"tree": args.label, **measure(name)}
        except Exception as exc:  # report the failure and go on
            row = {"tree": args.label, "model": name, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        rows.append(row)
        print(json.dumps(row), flush=True)
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
