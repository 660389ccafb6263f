"""Benchmark of Kiln's matmuls against torch (cuBLAS) on one GPU, in the same run.

The issue-10 shape list: float16/bfloat16 4096^3 and 8192 x 2048 x 8192 (x @ W and x @ W.T),
the BERT-base/GPT-2 linears (M in 128, 1024, 4096; K, N from 768, 2304, 3072), ViT-B/16's at
batch 8 (group `vit`, M = 1576), the
decode-shaped linears (M of 1, 4, 16 against Llama-sized weights) and the attention-shaped
batched matmuls. Each side runs as a CUDA graph of REPS calls (launch gaps out of
the numbers), timed with CUDA events, median of several replays, the two sides in alternating
rounds. Group `tf32` times float32 x @ W.T with TF32 allowed on both sides
(torch.backends.cuda.matmul.allow_tf32, which Kiln's linear then carries as `allow_tf32`);
group `fp32` float32 without TF32; every other group runs with TF32 off. Prints the GPU's name and a table; `--json PATH` writes every row.
Usage: python3 benchmarks/gemm_bench.py [--only square,tf32] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import math
import statistics

import torch

import kiln
from kiln.plugins.registry import registry

REPS = 20


def _task(op, args):
    """The task of `op` on `args`, allowed TF32 where they are float32 and torch allows it now."""
    definition = registry().operator(op)
    tf32 = args[0].dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32
    return definition.task(definition.bind([kiln.from_torch(t) for t in args], {"allow_tf32": True} if tf32 else {}))[0]


def _graph_time(fn) -> float:
    """Median seconds of one `fn()` call, from replays of a CUDA graph of REPS calls."""
    return _replay_timer(fn)()


def _replay_timer(fn):
    """A CUDA graph of REPS `fn()` calls, captured once, and a function that replays it and
    returns the median seconds of one call."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPS):
            fn()
    graph.replay()
    torch.cuda.synchronize()

    def time() -> float:
        times = []
        for _ in range(7):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / REPS)
        return statistics.median(times)
    return time


def _alternating_times(*fns, rounds=5) -> list[float]:
    """Median seconds of one call of each of `fns`, timed in `rounds` alternating rounds (the
    GPU's clock drifts between measurements: a side timed once, apart, can be 15% off)."""
    timers = [_replay_timer(fn) for fn in fns]
    times = [[timer() for timer in timers] for _ in range(rounds)]
    return [statistics.median(column) for column in zip(*times)]


def _case(name, op, args, reference, flops):
    from kiln.runtime.backend import backend_for
    from kiln.schedule import choose, schedules_for
    from kiln.schedule.tuner import tune
    task, device = _task(op, args), kiln.device("cuda")
    template = schedules_for(task, "cuda", 90)[0].name
    program = choose(task, "cuda", 90, lambda t: tune(task, t, device, 0))
    runner = backend_for(device).load(program, device)
    out = torch.empty(task.outputs[0].shape, dtype=args[0].dtype, device="cuda")
    runner(list(args), [out])
    ref = reference(*[a.double() for a in args])
    err = ((out.double() - ref).norm() / ref.norm()).item()
    t_kiln, t_torch = _alternating_times(lambda: runner(list(args), [out]), lambda: reference(*args))
    return {"name": name, "dtype": str(args[0].dtype)[6:], "template": template,
            "kiln_us": t_kiln * 1e6, "torch_us": t_torch * 1e6, "kiln_tflops": flops / t_kiln / 1e12,
            "torch_tflops": flops / t_torch / 1e12, "ratio": t_torch / t_kiln, "rel_err": err}


def _sweep(op, args, reference, flops) -> list[tuple[float, dict]]:
    """TFLOP/s of every gemm_sm90 knob setting (level-2 space and the cost model's first six),
    best first; settings that compute wrong results are reported and left out."""
    from kiln.runtime import cuda as rt
    from kiln.runtime.backend import backend_for
    from kiln_ops_builtin.templates import gemm_sm90
    task = _task(op, args)
    settings = []
    for knobs in gemm_sm90.suggest(task, torch.cuda.get_device_properties(0).multi_processor_count)[:6] \
            + gemm_sm90.TEMPLATE.space(2):
        if knobs not in settings:
            settings.append(knobs)
    programs = [gemm_sm90.render(task, **k) for k in settings]
    rt.compile_many([(p.source, p.kernel_names[0], "sm_90a") for p in programs])
    ref = reference(*[a.double() for a in args])
    out = torch.empty(task.outputs[0].shape, dtype=args[0].dtype, device="cuda")
    found = []
    for knobs, program in zip(settings, programs):
        runner = backend_for(kiln.device("cuda")).load(program, kiln.device("cuda"))
        out.fill_(float("nan"))
        runner(list(args), [out])
        err = ((out.double() - ref).norm() / ref.norm()).item()
        if not err < 1e-2:
            print(f"    WRONG {knobs}: relative error {err}", flush=True)
            continue
        found.append((flops / _graph_time(lambda: runner(list(args), [out])) / 1e12, knobs))
    return sorted(found, key=lambda f: -f[0])


def _r(*shape, dtype):
    return torch.empty(shape, dtype=dtype, device="cuda").uniform_(-1, 1)


def cases():
    lin = torch.nn.functional.linear
    for dtype in (torch.float16, torch.bfloat16):
        for M, K, N in ((4096, 4096, 4096), (8192, 2048, 8192)):
            yield ("square", f"{M}x{K}x{N} x@W", "matmul", (_r(M, K, dtype=dtype), _r(K, N, dtype=dtype)),
                   torch.matmul, 2 * M * N * K)
            yield ("square", f"{M}x{K}x{N} x@W.T", "linear", (_r(M, K, dtype=dtype), _r(N, K, dtype=dtype)),
                   lin, 2 * M * N * K)
    for M in (128, 1024, 4096):
        for K, N in ((768, 768), (768, 2304), (768, 3072), (3072, 768)):
            dtype = torch.float16
            yield ("linear", f"{M}x{K}x{N} x@W.T+b", "linear",
                   (_r(M, K, dtype=dtype), _r(N, K, dtype=dtype), _r(N, dtype=dtype)), lin, 2 * M * N * K)
    for K, N in ((768, 2304), (768, 768), (768, 3072), (3072, 768)):
        # GPT-2 small's training step at 8 x 512 tokens: forward and dX (its dW reads dY transposed, a
        # view that only a compiled graph hands the template)
        M, dtype = 4096, torch.bfloat16
        yield ("gpt2", f"{M}x{K}x{N} x@W.T+b", "linear",
               (_r(M, K, dtype=dtype), _r(N, K, dtype=dtype), _r(N, dtype=dtype)), lin, 2 * M * N * K)
        yield ("gpt2", f"{M}x{N}x{K} dY@W", "matmul", (_r(M, N, dtype=dtype), _r(N, K, dtype=dtype)), torch.matmul,
               2 * M * N * K)
    for K, N in ((768, 2304), (768, 768), (768, 3072), (3072, 768)):
        M, dtype = 1576, torch.float16      # ViT-B/16 at batch 8: 197 tokens an image
        yield ("vit", f"{M}x{K}x{N} x@W.T+b", "linear",
               (_r(M, K, dtype=dtype), _r(N, K, dtype=dtype), _r(N, dtype=dtype)), lin, 2 * M * N * K)
    for M in (1, 4, 16):
        for K, N in ((2048, 2048), (2048, 8192), (4096, 4096), (4096, 11008), (11008, 4096)):
            dtype = torch.bfloat16 if M == 4 else torch.float16
            yield ("decode", f"{M}x{K}x{N} x@W.T", "linear", (_r(M, K, dtype=dtype), _r(N, K, dtype=dtype)),
                   lin, 2 * M * N * K)
    for M, K, N in ((4096, 4096, 4096), (8192, 2048, 8192)):
        yield ("tf32", f"{M}x{K}x{N} x@W.T", "linear", (_r(M, K, dtype=torch.float32), _r(N, K, dtype=torch.float32)),
               lin, 2 * M * N * K)
    yield ("fp32", "4096x4096x4096 x@W", "matmul", (_r(4096, 4096, dtype=torch.float32),
                                                    _r(4096, 4096, dtype=torch.float32)), torch.matmul, 2 * 4096 ** 3)
    for B, M, K, N in ((96, 128, 64, 128), (96, 128, 128, 64), (32, 1024, 128, 1024)):
        dtype = torch.float16
        yield ("batched", f"{B}x{M}x{K}x{N}", "matmul", (_r(B, M, K, dtype=dtype), _r(B, K, N, dtype=dtype)),
               torch.matmul, 2 * B * M * N * K)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--sweep", default="", help="groups whose shapes also time every gemm_sm90 knob setting")
    parser.add_argument("--only", default="", help="comma-separated groups: square, linear, gpt2, vit, decode, tf32, fp32, "
                                                   "batched")
    opts = parser.parse_args()
    gpu = torch.cuda.get_device_name(0)
    print(f"GPU: {gpu}, torch {torch.__version__}", flush=True)
    rows = []
    for group, name, op, args, ref, flops in cases():
        if opts.only and group not in opts.only.split(","):
            continue
        torch.backends.cuda.matmul.allow_tf32 = group == "tf32"
        row = dict(_case(name, op, args, ref, flops), group=group)
        if group in opts.sweep.split(","):
            best = _sweep(op, args, ref, flops)
            row["sweep"] = [{"tflops": t, "knobs": k} for t, k in best]
            if best:
                print(f"    best {best[0][1]} {best[0][0]:.1f} TF; level 0 at {row['kiln_tflops'] / best[0][0]:.2f} of it",
                      flush=True)
        rows.append(row)
        print(f"{group:8s} {name:24s} {row['dtype']:9s} {row['template']:12s} kiln {row['kiln_us']:8.1f} us "
              f"{row['kiln_tflops']:6.1f} TF  torch {row['torch_us']:8.1f} us {row['torch_tflops']:6.1f} TF  "
              f"ratio {row['ratio']:.3f}  err {row['rel_err']:.1e}", flush=True)
    print(f"\n{'group':8s} {'shape':24s} {'dtype':9s} {'kiln TF':>8s} {'torch TF':>9s} {'ratio':>6s}")
    for r in rows:
        print(f"{r['group']:8s} {r['name']:24s} {r['dtype']:9s} {r['kiln_tflops']:8.1f} {r['torch_tflops']:9.1f} {r['ratio']:6.3f}")
    for group in dict.fromkeys(r["group"] for r in rows):
        ratios = [r["ratio"] for r in rows if r["group"] == group]
        print(f"{group}: geomean {math.exp(sum(map(math.log, ratios)) / len(ratios)):.3f}, min {min(ratios):.3f}")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"gpu": gpu, "torch": torch.__version__, "tf32": "group tf32 only", "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
