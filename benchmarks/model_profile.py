"""Kernels per forward pass and where the GPU time goes, Kiln against torch.compile's default backend.

For each model of `models_bench.CASES` (random weights, one GPU), one forward pass compiled by
Kiln and one compiled by Inductor run under torch.profiler with CUDA graphs off, so that every
launch shows: the number of kernels per forward, their summed GPU time, and the kernels that take
the most time, grouped by name. Kiln's kernels whose names say `transpose` or `simt` are counted
apart (issue 10 asks for none in BERT and GPT-2 at 16 bits).

    python benchmarks/model_profile.py [--models bert_b8 gpt2 ...] [--dtype float16] [--top 12]
        [--json out.json]
"""
from __future__ import annotations

import argparse
import collections
import json

import torch
from torch.profiler import ProfilerActivity, profile

from models_bench import CASES
from kernel_counts import randomize_batch_norm


def kernels_of_one_forward(fn, inputs) -> list[tuple[str, float]]:
    """(name, GPU microseconds) of every kernel one call launches, after warm-up."""
    for _ in range(3):
        fn(*inputs)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(*inputs)
        torch.cuda.synchronize()
    return [(e.name, e.device_time) for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA and _is_kernel(e.name)]


def _is_kernel(name: str) -> bool:
    return not name.startswith(("Memcpy", "Memset", "cudaMemcpy", "cudaMemset"))


def summary(kernels: list[tuple[str, float]], top: int) -> dict:
    """Count, total time and the heaviest kernel names."""
    by_name = collections.defaultdict(lambda: [0, 0.0])
    for name, us in kernels:
        by_name[name][0] += 1
        by_name[name][1] += us
    heaviest = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    return {
        "kernels": len(kernels),
        "gpu_us": sum(us for _, us in kernels),
        "transpose_or_simt": sum(n for name, (n, _) in by_name.items()
                                 if "transpose" in name or "simt" in name),
        "top": [{"name": name[:90], "calls": n, "us": round(us, 1)} for name, (n, us) in heaviest],
    }


def run_case(name: str, dtype: torch.dtype, top: int) -> dict:
    import kiln
    kiln.torch.dynamo_config.use_cuda_graph(False)
    torch.manual_seed(0)
    model, make_inputs = CASES[name]()
    randomize_batch_norm(model)
    model = model.to("cuda", dtype).eval()
    inputs = tuple(x.cuda() for x in make_inputs(dtype))
    row = {"model": name, "dtype": str(dtype).replace("torch.", "")}
    with torch.no_grad():
        for backend in ("kiln", "inductor"):
            torch._dynamo.reset()
            compiled = torch.compile(model, backend=backend)
            row[backend] = summary(kernels_of_one_forward(compiled, inputs), top)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["bert_b8", "gpt2"], choices=list(CASES))
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--json", help="write the rows to this file")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    rows = []
    for name in args.models:
        try:
            row = run_case(name, getattr(torch, args.dtype), args.top)
        except Exception as exc:  # report the failure and go on
            print(f"{name}: FAILED: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            rows.append({"model": name, "dtype": args.dtype, "error": f"{type(exc).__name__}: {exc}"})
            continue
        rows.append(row)
        k, i = row["kiln"], row["inductor"]
        print(f"\n{name} {args.dtype}: kernels per forward Kiln {k['kernels']} / Inductor {i['kernels']}; "
              f"GPU time {k['gpu_us']:.0f} / {i['gpu_us']:.0f} us; Kiln transpose or SIMT kernels: "
              f"{k['transpose_or_simt']}")
        for backend in ("kiln", "inductor"):
            print(f"  {backend}:")
            for t in row[backend]["top"]:
                print(f"    {t['us']:>9.1f} us {t['calls']:>4}x  {t['name']}")
        print(flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
