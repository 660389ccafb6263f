"""Benchmark of Kiln's attention for training (`attention_forward`, `attention_backward`: the
`attention_train` templates) against torch's flash scaled_dot_product_attention, forward and
forward + backward, on one GPU in the same run.

Shapes: GPT-2 small's (batch 8, 12 heads, 512 tokens, dim 64, causal) and a Llama's (1, 32,
512, 64 and 128, causal), bf16 (`--dtype float16` for fp16). Kiln's side calls the built
programs directly (the kernels' time, no operator dispatch); torch's calls sdpa under
`sdpa_kernel(FLASH_ATTENTION)` and autograd's backward. Each time is the median of 9 replays of a
CUDA graph of REPS calls, timed with CUDA events (kernel time: no launch gaps, no host overhead).
`--knobs` also times every tuning candidate of level 1.
Usage: python3 benchmarks/attention_train_bench.py [--json out.json] [--knobs] [--dtype float16]
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import kiln
from kiln.plugins.registry import registry
from kiln.runtime.backend import backend_for
from kiln_ops_builtin.templates import attention_train

REPS = 20
SHAPES = [  # name, batch, heads, L, dim, causal
    ("gpt2", 8, 12, 512, 64, True),
    ("llama-d64", 1, 32, 512, 64, True),
    ("llama-d128", 1, 32, 512, 128, True),
    ("gpt2-1k", 8, 12, 1024, 64, True),
    ("noncausal-d128", 4, 16, 1024, 128, False),
    ("llama-2k-d128", 1, 32, 2048, 128, True),
]


def _time(fn) -> float:
    """Median milliseconds of one fn() call: 9 replays of a CUDA graph of REPS calls (launch gaps
    and the host's overhead out of the numbers), CUDA events around each."""
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
    times = []
    for _ in range(9):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / REPS)
    return statistics.median(times)


def _programs(q, k, v, causal, fknobs=None, bknobs=None):
    device = kiln.device("cuda")
    fwd, bwd = registry().operator("attention_forward"), registry().operator("attention_backward")
    lse = torch.zeros(q.shape[:-1], device=q.device)
    tf = fwd.task(fwd.bind([kiln.from_torch(t) for t in (q, k, v)] + [None, causal], {}))[0]
    tb = bwd.task(bwd.bind([kiln.from_torch(t) for t in (q, q, k, v, q, lse)] + [None, causal], {}))[0]
    load = backend_for(device).load
    fknobs = fknobs or attention_train.FORWARD.suggest(tf, torch.cuda.get_device_properties(0).multi_processor_count)[0]
    return (load(attention_train.render_forward(tf, **fknobs), device),
            load(attention_train.render_backward(tb, **(bknobs or {})), device))


def bench(name, b, h, n, d, causal, dtype, fknobs=None, bknobs=None) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(b, h, n, d, device="cuda", dtype=dtype, generator=g) for _ in range(4))
    forward, backward = _programs(q, k, v, causal, fknobs, bknobs)
    out, lse = torch.empty_like(q), torch.empty(q.shape[:-1], device="cuda")
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def kiln_fwd():
        forward([q, k, v], [out, lse])

    def kiln_fwd_bwd():
        forward([q, k, v], [out, lse])
        backward([dout, q, k, v, out, lse], [dq, dk, dv])

    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))

    def torch_fwd():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION), torch.no_grad():
            F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def torch_fwd_bwd():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
        torch.autograd.grad(o, (qg, kg, vg), dout)

    flops = 4 * b * h * n * n * d * (0.5 if causal else 1.0)       # forward: two GEMMs
    row = {"shape": name, "batch": b, "heads": h, "L": n, "D": d, "causal": causal, "dtype": str(dtype),
           "fknobs": fknobs, "bknobs": bknobs}
    for key, fn in (("kiln_fwd_ms", kiln_fwd), ("torch_fwd_ms", torch_fwd), ("kiln_fwd_bwd_ms", kiln_fwd_bwd),
                    ("torch_fwd_bwd_ms", torch_fwd_bwd)):
        row[key] = _time(fn)
    row["kiln_fwd_tflops"] = flops / row["kiln_fwd_ms"] / 1e9
    row["kiln_fwd_bwd_tflops"] = 3.5 * flops / row["kiln_fwd_bwd_ms"] / 1e9     # FA2's count: backward 2.5x
    row["fwd_ratio"] = row["torch_fwd_ms"] / row["kiln_fwd_ms"]
    row["fwd_bwd_ratio"] = row["torch_fwd_bwd_ms"] / row["kiln_fwd_bwd_ms"]
    return row


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--knobs", action="store_true")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    print(torch.cuda.get_device_name(), torch.__version__)
    rows = []
    print(f"{'shape':16} {'kiln fwd':>9} {'torch fwd':>9} {'ratio':>6} {'kiln f+b':>9} {'torch f+b':>9} {'ratio':>6}"
          "  (ms; ratio = torch / kiln, above 1: Kiln faster)")
    settings = [(None, None)]
    if args.knobs:
        settings += [(f, None) for f in attention_train.ForwardKnobs.settings(1)[1:]]
        settings += [(None, b) for b in attention_train.BackwardKnobs.settings(1)[1:]]
    for shape in SHAPES:
        for fknobs, bknobs in settings:
            r = bench(*shape, dtype, fknobs, bknobs)
            rows.append(r)
            tag = shape[0] + ("" if fknobs is None and bknobs is None else f" {fknobs or bknobs}")
            print(f"{tag:16} {r['kiln_fwd_ms']:9.3f} {r['torch_fwd_ms']:9.3f} {r['fwd_ratio']:6.2f} "
                  f"{r['kiln_fwd_bwd_ms']:9.3f} {r['torch_fwd_bwd_ms']:9.3f} {r['fwd_bwd_ratio']:6.2f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
