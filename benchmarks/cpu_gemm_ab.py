"""gemm_cpu knob settings against each other on the CPU linear layers of `cpu_bench.py`'s BERT and
Llama (M = 128 rows), in one process, in alternating rounds.

Each setting of `--knobs` (`gemm_cpu.GemmKnobs` fields; the defaults where a field is left out)
renders the linear task (x @ w.T + b) and runs its kernel on the weight laid out once
(`CpuKernel.prepare`), as a compiled graph does. A model's weights outgrow the caches, so each
setting gets several weights, `--cold-mb` megabytes in all, and a call takes the next (`--cold-mb
0`: one weight, hot in the caches). Every setting is checked against float64 first; then each
round calls every setting once, `--rounds` rounds, so that a drift of a shared machine touches
all alike. A time is the median over rounds (thread CPU time on one thread, which other
processes do not inflate; wall-clock on more), printed with GFLOP/s and the quartiles.

    python benchmarks/cpu_gemm_ab.py [--knobs '[{"B_PREFETCH": 0}, {}]'] [--threads 1]
        [--rounds 60] [--cold-mb 300] [--shapes 128x768x768 ...]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

import kiln
from kiln.runtime.cpu import CpuKernel
from kiln_ops_builtin.templates import gemm_cpu

# MxKxN: BERT-base's attention output, fused QKV, MLP up and down; the Llama's q and o, k and v,
# SwiGLU's gate and up, down, and its head
SHAPES = ["128x768x768", "128x768x2304", "128x768x3072", "128x3072x768",
          "128x512x512", "128x512x256", "128x512x2752", "128x1376x512", "128x512x8000"]


def kernels(m: int, k: int, n: int, knobs: dict, weights: list[tuple[torch.Tensor, torch.Tensor]], x: torch.Tensor):
    """The linear kernel of `knobs`, one call per weight of `weights` ((w, b) pairs): closures."""
    op = kiln.ops.linear
    task, _, _ = op.task(op.bind((kiln.from_torch(x), kiln.from_torch(weights[0][0]),
                                  kiln.from_torch(weights[0][1])), {}))
    kernel, out = CpuKernel(gemm_cpu.render(task, **knobs)), torch.empty(m, n)
    calls = []
    for w, b in weights:
        prepared, form = kernel.prepare([None, w, None])
        calls.append(lambda prepared=prepared, w=w, b=b, form=form: prepared([x, w, b, form], [out]) or out)
    want = F.linear(x.double(), weights[0][0].double(), weights[0][1].double())
    error = float((calls[0]().double() - want).abs().max() / want.abs().max())
    if error > 1e-5:
        raise AssertionError(f"{m}x{k}x{n} at {knobs}: relative error {error:.1e}")
    return calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--knobs", default='[{"B_PREFETCH": 0}, {}]', help="a JSON list of settings")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--cold-mb", type=int, default=300, help="the weights' megabytes per setting (0: one)")
    parser.add_argument("--shapes", nargs="+", default=SHAPES, help="MxKxN")
    opts = parser.parse_args()
    settings = json.loads(opts.knobs)
    torch.manual_seed(0)
    torch.set_num_threads(opts.threads)
    clock = time.thread_time if opts.threads == 1 else time.perf_counter
    totals = [0.0] * len(settings)
    for shape in opts.shapes:
        m, k, n = (int(v) for v in shape.split("x"))
        copies = max(1, (opts.cold_mb << 20) // (4 * k * n))
        x = torch.randn(m, k)
        weights = [(torch.randn(n, k) / k ** 0.5, torch.randn(n)) for _ in range(copies)]
        calls = [kernels(m, k, n, knobs, weights, x) for knobs in settings]
        times = [[] for _ in settings]
        for r in range(opts.rounds):
            for s, setting_calls in enumerate(calls):
                start = clock()
                setting_calls[r % copies]()
                times[s].append(clock() - start)
        parts = []
        for s, samples in enumerate(times):
            q = statistics.quantiles(samples, n=4)
            median = statistics.median(samples)
            totals[s] += median
            parts.append(f"{s}: {median * 1e3:7.3f} ms {2 * m * k * n / median / 1e9:6.1f} GFLOP/s "
                         f"(quartiles {q[0] * 1e3:.3f}-{q[2] * 1e3:.3f})")
        print(f"{shape:13s} x{copies:<3d} " + " | ".join(parts), flush=True)
    for s, knobs in enumerate(settings):
        print(f"setting {s} {knobs}: {totals[s] * 1e3:.3f} ms over the shapes")


if __name__ == "__main__":
    main()
