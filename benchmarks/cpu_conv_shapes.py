"""Kiln's convolutions inside a CPU model, shape by shape, against torch's own (oneDNN, which eager
and Inductor call) at the same shapes.

The model (`cpu_bench.CASES`, random weights, batch norms randomized) is compiled by Kiln and each
step of its CompiledGraph is timed alone on the buffers of one forward pass
(`kernel_times.time_steps`: the median of `--repeats` calls; a step's inputs may stay in cache
between calls, which the model's order would not give them; the whole-graph cache is off, so that
the steps keep their tasks). Convolution steps are grouped by
shape (input, weight, stride, padding; a fused group's anchor, with its epilogue: bias, folded
batch norm, activation, residual add), and each shape's `F.conv2d` with a bias is timed the same
way. Prints per shape: the steps, Kiln's and torch's median microseconds, both in GFLOP/s, torch
over Kiln, and the sums over the model's steps; then the model's other steps summed.

    python benchmarks/cpu_conv_shapes.py [--case resnet50_b8] [--threads 1] [--repeats 7] [--json out.json]
"""
from __future__ import annotations

import argparse
import collections
import json
import statistics

import torch
import torch.nn.functional as F

from cpu_bench import CASES
from kernel_counts import randomize_batch_norm
from kernel_times import _host_time, graph_runs, time_steps


def kiln_steps(case: str, repeats: int) -> list[dict]:
    """Every step of `case` compiled by Kiln: operator (a fused group's anchor), input shapes,
    attributes and median microseconds. The whole-graph cache is off: a graph it returns keeps its
    kernels, not their tasks."""
    from kiln.frontend.torch import dynamo_config
    dynamo_config.graph_cache(False)
    torch.manual_seed(0)
    model, inputs = CASES[case]()
    randomize_batch_norm(model)
    model.eval()
    rows = []
    with torch.no_grad():
        compiled = torch.compile(model, backend="kiln")
        compiled(*inputs)
        for graph, graph_inputs in graph_runs(lambda: compiled(*inputs)):
            for step, us in zip(graph.steps, time_steps(graph, graph_inputs, repeats)):
                task = getattr(step.kernel, "task", None)
                rows.append({"operator": task.attrs.get("anchor_operator", task.name) if task else "?",
                             "inputs": [list(t.shape) for t in task.inputs] if task else [],
                             "output": list(task.outputs[0].shape) if task else [],
                             "attrs": {k: task.attrs[k] for k in ("stride", "padding", "dilation", "groups")
                                       if task and k in task.attrs},
                             "us": us})
    return rows


def by_shape(rows: list[dict], repeats: int) -> list[dict]:
    """The convolution steps of `rows` grouped by shape, with torch's time at each shape."""
    groups = collections.OrderedDict()
    for r in rows:
        if r["operator"] != "conv2d":
            continue
        x, w = r["inputs"][0], r["inputs"][1]
        key = (tuple(x), tuple(w), str(r["attrs"].get("stride")), str(r["attrs"].get("padding")),
               str(r["attrs"].get("dilation")), r["attrs"].get("groups", 1))
        g = groups.setdefault(key, {"input": x, "weight": w, "output": r["output"], "attrs": r["attrs"], "us": []})
        g["us"].append(r["us"])
    out = []
    for g in groups.values():
        a = g["attrs"]
        x, w, b = torch.randn(g["input"]), torch.randn(g["weight"]), torch.randn(g["weight"][0])
        torch_us = _host_time(lambda: F.conv2d(x, w, b, a.get("stride", 1), a.get("padding", 0), a.get("dilation", 1),
                                               a.get("groups", 1)), repeats)
        flop = 2 * torch.Size(g["output"]).numel() * g["weight"][1] * g["weight"][2] * g["weight"][3]
        kiln_us = statistics.median(g["us"])
        out.append({**g, "steps": len(g["us"]), "kiln_us": round(kiln_us, 1), "torch_us": round(torch_us, 1),
                    "kiln_gflops": round(flop / kiln_us / 1e3, 1), "torch_gflops": round(flop / torch_us / 1e3, 1),
                    "torch_over_kiln": round(torch_us / kiln_us, 2), "kiln_sum_ms": round(sum(g["us"]) / 1e3, 2),
                    "torch_sum_ms": round(torch_us * len(g["us"]) / 1e3, 2)})
    return sorted(out, key=lambda s: -s["kiln_sum_ms"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--case", default="resnet50_b8", choices=list(CASES))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", help="write the shapes and steps to this file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = kiln_steps(args.case, args.repeats)
    shapes = by_shape(rows, args.repeats)
    print(f"{args.case}, {args.threads} thread(s): convolutions by shape (median us of a step alone)")
    print("| input | weight | stride | steps | Kiln us | torch us | Kiln GFLOP/s | torch GFLOP/s | torch/Kiln "
          "| Kiln sum ms | torch sum ms |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for s in shapes:
        print(f"| {s['input']} | {s['weight']} | {s['attrs'].get('stride')} | {s['steps']} | {s['kiln_us']:.0f} "
              f"| {s['torch_us']:.0f} | {s['kiln_gflops']} | {s['torch_gflops']} | {s['torch_over_kiln']:.2f} "
              f"| {s['kiln_sum_ms']:.1f} | {s['torch_sum_ms']:.1f} |")
    conv_ms = sum(s["kiln_sum_ms"] for s in shapes)
    other_ms = sum(r["us"] for r in rows if r["operator"] != "conv2d") / 1e3
    print(f"convolutions: Kiln {conv_ms:.1f} ms, torch {sum(s['torch_sum_ms'] for s in shapes):.1f} ms; "
          f"Kiln's other steps {other_ms:.1f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"case": args.case, "threads": args.threads, "shapes": shapes, "steps": rows}, f, indent=1)


if __name__ == "__main__":
    main()
