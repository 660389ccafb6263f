"""Where Kiln's GPU time goes inside one model: every kernel of the compiled graph timed in place.

For each model of `models_bench.CASES` (random weights, one GPU), compiled by Kiln with CUDA graphs
off, each step of its CompiledGraphs is timed alone on the buffers of one forward pass, as replays
of a CUDA graph of repeated calls (launch gaps out of the numbers; a step's inputs may stay in
the L2 cache between its calls, which the model's order of kernels would not give them). Prints
the time summed by operator (a fused group's anchor), then the heaviest steps with their
operator, output shape and kernel names. The whole model's time comes from `models_bench.py`.

    python benchmarks/kernel_times.py [--models resnet50_b32 ...] [--dtype float16] [--top 25]
        [--device cuda] [--json out.json]
"""
from __future__ import annotations

import argparse
import collections
import json
import statistics
import time

import torch

from kernel_counts import randomize_batch_norm
from kiln.runtime.compiled_graph import CompiledGraph
from models_bench import CASES


def describe(step) -> dict:
    """Operator (a fused group's anchor), output shapes and kernel names of a step's CompiledTask."""
    compiled = step.kernel
    task = getattr(compiled, "task", None)
    program = getattr(getattr(compiled, "kernel", None), "program", None)
    anchor = task.attrs.get("anchor_operator", task.name) if task is not None else "?"
    return {
        "operator": anchor,
        "shapes": [list(o.shape) for o in task.outputs] if task is not None else [],
        "kernels": getattr(program, "kernel_names", []),
    }


def time_steps(graph, inputs, reps: int = 20) -> list[float]:
    """Microseconds of each step of `graph` run on `inputs`: on a GPU the median over replays of a
    CUDA graph of `reps` calls of the step alone, on its own buffers of one run (launch gaps out
    of the numbers); on the CPU the median of `reps` calls, timed by the host clock."""
    calls = []
    original = [s.kernel for s in graph.steps]

    def keeping(k, kernel):
        def call(ins, outs):
            calls.append((k, list(ins), list(outs)))
            kernel(ins, outs)
        return call

    for k, step in enumerate(graph.steps):
        object.__setattr__(step, "kernel", keeping(k, step.kernel))
    try:
        graph.run(inputs)
    finally:
        for step, kernel in zip(graph.steps, original):
            object.__setattr__(step, "kernel", kernel)
    times = [0.0] * len(graph.steps)
    for k, ins, outs in calls:
        run = lambda: original[k](ins, outs)
        times[k] = _graph_time(run, reps) if ins and ins[0].is_cuda else _host_time(run, reps)
    return times


def _graph_time(fn, reps: int) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(reps):
                fn()
    torch.cuda.current_stream().wait_stream(stream)
    samples = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / reps)
    return statistics.median(samples)


def _host_time(fn, reps: int) -> float:
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e6)
    return statistics.median(samples)


def graph_runs(call) -> list[tuple]:
    """(CompiledGraph, its inputs) of every graph that `call()` runs (forward and backward
    graphs of a training step alike)."""
    runs = {}
    original = CompiledGraph.run

    def run(self, graph_inputs, workspace=None):
        runs.setdefault(id(self), (self, list(graph_inputs)))
        return original(self, graph_inputs, workspace)

    CompiledGraph.run = run
    try:
        call()
    finally:
        CompiledGraph.run = original
    return list(runs.values())


def run_case(name: str, dtype: torch.dtype, top: int, device: str) -> dict:
    import kiln
    kiln.torch.dynamo_config.use_cuda_graph(False)
    torch.manual_seed(0)
    model, make_inputs = CASES[name]()
    randomize_batch_norm(model)
    model = model.to(device, dtype).eval()
    inputs = tuple(x.to(device) for x in make_inputs(dtype))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="kiln")
    rows = []
    with torch.no_grad():
        compiled(*inputs)
        for graph, graph_inputs in graph_runs(lambda: compiled(*inputs)):
            times = time_steps(graph, graph_inputs)
            rows += [dict(describe(step), us=round(us, 2)) for step, us in zip(graph.steps, times)]
    by_operator = collections.defaultdict(lambda: [0, 0.0])
    for r in rows:
        by_operator[r["operator"]][0] += 1
        by_operator[r["operator"]][1] += r["us"]
    return {"model": name, "dtype": str(dtype).replace("torch.", ""), "steps": rows,
            "total_us": sum(r["us"] for r in rows),
            "by_operator": {k: {"steps": n, "us": round(us, 1)} for k, (n, us) in
                            sorted(by_operator.items(), key=lambda kv: -kv[1][1])},
            "top": sorted(rows, key=lambda r: -r["us"])[:top]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["resnet50_b32"], choices=list(CASES))
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--json", help="write the rows to this file")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if args.device == "cuda":
        print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    out = []
    for name in args.models:
        try:
            r = run_case(name, getattr(torch, args.dtype), args.top, args.device)
        except Exception as exc:  # report the failure and go on
            print(f"{name}: FAILED: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            continue
        out.append(r)
        print(f"\n{name} {args.dtype}: {len(r['steps'])} steps, {r['total_us']:.0f} us in all")
        for op, v in list(r["by_operator"].items())[:12]:
            print(f"  {v['us']:>9.1f} us {v['steps']:>4}x  {op}")
        print("  heaviest steps:")
        for t in r["top"]:
            print(f"  {t['us']:>8.1f} us  {t['operator']:<24} {t['shapes']} {','.join(t['kernels'])}")
        print(flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
