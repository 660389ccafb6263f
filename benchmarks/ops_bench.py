"""Operator benchmark on a CUDA GPU: Kiln's kernels against PyTorch in the same run.

For each case it times Kiln's built kernel, PyTorch eager (cuBLAS, cuDNN, its own kernels)
and, with --compile, torch.compile's default backend; every time is the median over CUDA
events of a captured CUDA graph of 10 runs (so host overhead is out of all three), with inputs
rotated over enough copies to exceed the L2 cache. It prints a table of times and ratios
(>1: Kiln faster) and writes the same as JSON.

    python benchmarks/ops_bench.py --suite all --json results.json

`--suite skinny` times BERT-base/GPT-2 at batch 1 x 128 tokens: the linear layers (with bias,
weight [N, K] as nn.Linear keeps it) and the per-head attention products; `--suite conv16`
times ResNet-50's convolutions in float16/bfloat16 and depthwise convolutions; `--suite columns`
the column reductions of GPT-2 training (`column_cases`, also part of `norm`); `--level` sets
the tuning level of every case (0 is what models get by default). Kiln is imported from the
environment, so that one script times two checkouts, each on its own PYTHONPATH.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F

REPS_IN_GRAPH = 10
L2_BYTES = 256 << 20


def device_time_ms(fn_for_copy, copies: int, samples: int = 15) -> float:
    """Median ms of one call, timed as CUDA-graph replays of REPS_IN_GRAPH calls."""
    for k in range(3):
        fn_for_copy(k % copies)
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        fn_for_copy(0)
        with torch.cuda.graph(graph, stream=stream):
            for k in range(REPS_IN_GRAPH):
                fn_for_copy(k % copies)
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(samples):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / REPS_IN_GRAPH)
    return statistics.median(times)


def copy_bandwidth() -> float:
    """The GPU's device-to-device copy bandwidth in GB/s (bytes read + written)."""
    src = torch.empty(1 << 28, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    ms = device_time_ms(lambda k: dst.copy_(src), 1)
    return 2 * src.numel() * 4 / ms / 1e6


def kiln_callable(op: str, args: list, kwargs: dict):
    """fn(inputs) -> outputs running Kiln's built kernel for this call (built and tuned now)."""
    import kiln
    from kiln.graph.operator import compiled_task
    from kiln.plugins.registry import registry
    definition = registry().operator(op)
    task, _, _ = definition.task(definition.bind(args, kwargs))
    compiled = compiled_task(task, kiln.device("cuda"))
    outputs = [torch.empty(o.shape, dtype=o.dtype.torch_dtype, device="cuda") for o in task.outputs]
    return lambda inputs: compiled(inputs, outputs)


def kiln_graph_callable(build, tensors: list):
    """fn(inputs) -> outputs running Kiln's optimized graph of `build(*symbols)`, one CUDA symbol
    per tensor of `tensors` (views fused into the kernels that read them)."""
    import kiln
    symbols = [kiln.symbol(list(t.shape), str(t.dtype).replace("torch.", ""), "cuda") for t in tensors]
    return kiln.graph.optimize(kiln.trace_from(build(*symbols), symbols)).compile().run


def _bn_var(x):
    """Batch-norm statistics of NHWC data `x` as a channels-last training graph reads them."""
    import kiln
    return kiln.ops.var(kiln.ops.permute(x, [0, 3, 1, 2]), [0, 2, 3], 0, True)


def _bn_sum(x):
    """A batch-norm gradient's sum over N, H and W of NHWC data `x`, through its NCHW view."""
    import kiln
    return kiln.ops.sum(kiln.ops.permute(x, [0, 3, 1, 2]), [0, 2, 3])


def _widened_sum(x):
    """A 16-bit tensor summed over its rows in float32, as `x.float().sum(0)`."""
    import kiln
    return kiln.ops.sum(kiln.ops.cast(x, torch.float32), [0])


def _product_sum(x, y):
    """sum(x * y) over rows: a layer norm's weight gradient, sum(dy * xhat)."""
    import kiln
    return kiln.ops.sum(kiln.ops.mul(x, y), [0])


def column_cases():
    """Column reductions of a GPT-2 small training step (8 x 512 tokens): bias gradients, sums
    over the 4096 rows of [4096, 768 / 2304 / 3072], also of 16-bit data summed in float32; a
    layer norm's weight gradient over [4096, 768] in float32. Bytes: what is read and written."""
    cases = []
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        size = torch.tensor([], dtype=dt).element_size()
        for rows, cols in ((4096, 768), (4096, 2304), (4096, 3072)):
            make = lambda dt, r=rows, c=cols: ([torch.randn(r, c, device="cuda").to(dt)], [])
            cases.append((f"column sum {rows}x{cols}", "sum",
                          lambda dt, r=rows, c=cols: ([torch.randn(r, c, device="cuda").to(dt)], [[0]]),
                          lambda x, d: torch.sum(x, d), None, (rows + 1) * cols * size, dt, 0))
            if size == 2:
                cases.append((f"column float sum {rows}x{cols}", _widened_sum, make, lambda x: x.float().sum(0),
                              None, rows * cols * size + cols * 4, dt, 0))
    make = lambda dt: ([torch.randn(4096, 768, device="cuda").to(dt) for _ in range(2)], [])
    cases.append(("column product sum 4096x768", _product_sum, make, lambda x, y: (x * y).sum(0), None,
                  (2 * 4096 + 1) * 768 * 4, torch.float32, 0))
    return cases


def case_list(suite: str, quick: bool, tune_level: int | None = None):
    """(name, kiln op (or a function of Kiln symbols building a graph), make(dtype) -> (tensor args,
    extra args), torch fn, flops(args), bytes(args), dtype, level);
    `tune_level` overrides each case's tuning level."""
    cases = []
    if suite in ("matmul", "all"):
        shapes = [(1024, 1024, 1024), (4096, 4096, 4096), (128, 768, 768), (512, 768, 3072),
                  (4096, 768, 768), (4096, 768, 3072), (4096, 3072, 768)]
        if quick:
            shapes = [(4096, 4096, 4096)]
        for dt in (torch.float16, torch.bfloat16, torch.float32):
            for m, k, n in shapes:
                level = 2 if (m, k, n) == (4096, 4096, 4096) else 1
                cases.append((f"matmul {m}x{k}x{n}", "matmul",
                              lambda dt, m=m, k=k, n=n: ([torch.randn(m, k, device="cuda").to(dt),
                                                          torch.randn(k, n, device="cuda").to(dt)], []),
                              torch.matmul, 2 * m * n * k, None, dt, level))
    if suite in ("norm", "columns", "all"):
        cases += column_cases()
    if suite in ("norm", "all"):
        for dt in (torch.float32, torch.float16):
            for rows, cols in ((4096, 768), (4096, 4096)):
                nbytes = 2 * rows * cols * torch.tensor([], dtype=dt).element_size()
                cases.append((f"softmax {rows}x{cols}", "softmax",
                              lambda dt, r=rows, c=cols: ([torch.randn(r, c, device="cuda").to(dt)], [-1]),
                              lambda x, d: torch.softmax(x, d), None, nbytes, dt, 0))
                cases.append((f"layer_norm {rows}x{cols}", "layer_norm",
                              lambda dt, r=rows, c=cols: ([torch.randn(r, c, device="cuda").to(dt)], [(c,)]),
                              lambda x, s: F.layer_norm(x, s), None, nbytes, dt, 0))
        # batch-norm statistics of ResNet-50 b32 training (issue 32): of channels-last data (NHWC
        # memory, reduced through its NCHW view as a channels-last training graph reads it: Kiln
        # runs the graph, the view fused into the reduction; eager reads the channels_last tensor)
        # and of NCHW data
        for dt in (torch.bfloat16, torch.float32):
            for n, c, hw in ((32, 64, 112), (32, 256, 56), (32, 512, 28), (32, 2048, 7)):
                nbytes = n * c * hw * hw * torch.tensor([], dtype=dt).element_size()
                nhwc = lambda dt, n=n, c=c, hw=hw: ([torch.randn(n, hw, hw, c, device="cuda").to(dt)], [])
                shape = f"{n}x{c}x{hw}x{hw}"
                cases.append((f"bn stats channels_last {shape}", _bn_var, nhwc,
                              lambda x: torch.var(x.permute(0, 3, 1, 2), (0, 2, 3), correction=0, keepdim=True),
                              None, nbytes, dt, 0))
                cases.append((f"bn sum channels_last {shape}", _bn_sum, nhwc,
                              lambda x: torch.sum(x.permute(0, 3, 1, 2), (0, 2, 3)), None, nbytes, dt, 0))
                nchw = lambda dt, n=n, c=c, hw=hw: ([torch.randn(n, c, hw, hw, device="cuda").to(dt)], [[0, 2, 3]])
                cases.append((f"bn sum nchw {shape}", "sum", nchw, lambda x, d: torch.sum(x, d), None, nbytes, dt, 0))
    if suite in ("conv", "all"):
        convs = [(64, 56, 64, 3, 1), (64, 56, 256, 1, 1), (256, 56, 64, 1, 1), (128, 28, 128, 3, 1),
                 (512, 7, 512, 3, 1), (3, 224, 64, 7, 2)]
        for batch in (1, 32):
            for cin, hw, cout, ks, stride in convs:
                flops = 2 * batch * cout * cin * ks * ks * (hw // stride) ** 2
                cases.append((f"conv2d b{batch} {cin}x{hw}x{hw}->{cout} k{ks}s{stride}", "conv2d",
                              lambda dt, b=batch, ci=cin, h=hw, co=cout, kk=ks, s=stride: (
                                  [torch.randn(b, ci, h, h, device="cuda").to(dt),
                                   torch.randn(co, ci, kk, kk, device="cuda").to(dt) * 0.1],
                                  [None, s, kk // 2]),
                              F.conv2d, flops, None, torch.float32, 0))
    if suite == "skinny":
        for dt in (torch.float16, torch.bfloat16, torch.float32):
            for m, k, n in ((128, 768, 768), (128, 768, 2304), (128, 768, 3072), (128, 3072, 768)):
                cases.append((f"linear {m}x{k}x{n} +bias", "linear",
                              lambda dt, m=m, k=k, n=n: ([torch.randn(m, k, device="cuda").to(dt),
                                                          torch.randn(n, k, device="cuda").to(dt) * 0.05,
                                                          torch.randn(n, device="cuda").to(dt)], []),
                              F.linear, 2 * m * n * k, None, dt, 0))
            for name, a, b in (("q@k^T 12x128x64x128", (12, 128, 64), (12, 64, 128)),
                               ("p@v 12x128x128x64", (12, 128, 128), (12, 128, 64))):
                cases.append((f"bmm {name}", "matmul",
                              lambda dt, a=a, b=b: ([torch.randn(a, device="cuda").to(dt),
                                                     torch.randn(b, device="cuda").to(dt)], []),
                              torch.matmul, 2 * a[0] * a[1] * a[2] * b[2], None, dt, 0))
    if suite == "conv16":
        # ResNet-50's convolutions (stem, 1x1, 3x3, strided 1x1 downsample, 7x7 late layers) in
        # 16-bit floats, then depthwise convolutions in float32 and float16
        convs = [(3, 224, 64, 7, 2), (64, 56, 64, 3, 1), (64, 56, 256, 1, 1), (256, 56, 64, 1, 1),
                 (256, 56, 512, 1, 2), (128, 28, 128, 3, 1), (512, 7, 512, 3, 1), (2048, 7, 512, 1, 1)]
        for dt in (torch.float16, torch.bfloat16):
            for batch in (1, 32):
                for cin, hw, cout, ks, stride in convs:
                    flops = 2 * batch * cout * cin * ks * ks * (-(-hw // stride)) ** 2
                    cases.append((f"conv2d b{batch} {cin}x{hw}x{hw}->{cout} k{ks}s{stride}", "conv2d",
                                  lambda dt, b=batch, ci=cin, h=hw, co=cout, kk=ks, s=stride: (
                                      [torch.randn(b, ci, h, h, device="cuda").to(dt),
                                       torch.randn(co, ci, kk, kk, device="cuda").to(dt) * 0.1],
                                      [None, s, kk // 2]),
                                  F.conv2d, flops, None, dt, 0))
        for dt in (torch.float32, torch.float16):
            for batch, c, hw, ks, stride in ((1, 96, 56, 7, 1), (32, 96, 56, 7, 1), (1, 384, 14, 7, 1),
                                             (32, 144, 56, 3, 2), (32, 32, 112, 3, 1)):
                out = -(-hw // stride)
                nbytes = batch * c * (hw * hw + out * out) * torch.tensor([], dtype=dt).element_size()
                cases.append((f"depthwise b{batch} {c}x{hw}x{hw} k{ks}s{stride}", "conv2d",
                              lambda dt, b=batch, c=c, h=hw, kk=ks, s=stride: (
                                  [torch.randn(b, c, h, h, device="cuda").to(dt),
                                   torch.randn(c, 1, kk, kk, device="cuda").to(dt) * 0.1],
                                  [None, s, kk // 2, 1, c]),
                              F.conv2d, 2 * batch * c * ks * ks * out * out, nbytes, dt, 0))
    if tune_level is not None:
        cases = [c[:-1] + (tune_level,) for c in cases]
    return cases


def run_case(case, use_compile: bool) -> dict:
    name, op, make, torch_fn, flops, nbytes, dt, level = case
    os.environ["KILN_TUNE_LEVEL"] = str(level)
    tensors, extra = make(dt)
    size = sum(t.numel() * t.element_size() for t in tensors)
    copies = max(1, min(8, L2_BYTES // max(size, 1)))
    sets = [tensors] + [[t.clone() for t in tensors] for _ in range(copies - 1)]
    t0 = time.time()
    kiln_fn = kiln_graph_callable(op, tensors) if callable(op) else kiln_callable(op, tensors + extra, {})
    build_s = time.time() - t0
    row = {"case": name, "dtype": str(dt).replace("torch.", ""), "tune_level": level, "build_s": round(build_s, 2)}
    expected = torch_fn(*tensors, *extra).double()
    got = kiln_fn(tensors)[0].double()
    row["rel_err"] = ((got - expected).norm() / expected.norm().clamp_min(1e-30)).item()
    row["kiln_ms"] = device_time_ms(lambda k: kiln_fn(sets[k]), copies)
    row["eager_ms"] = device_time_ms(lambda k: torch_fn(*sets[k], *extra), copies)
    if use_compile:
        compiled = torch.compile(torch_fn)
        row["compile_ms"] = device_time_ms(lambda k: compiled(*sets[k], *extra), copies)
    if flops:
        row["kiln_tflops"] = flops / row["kiln_ms"] / 1e9
        row["eager_tflops"] = flops / row["eager_ms"] / 1e9
    if nbytes:
        row["kiln_gbps"] = nbytes / row["kiln_ms"] / 1e6
        row["eager_gbps"] = nbytes / row["eager_ms"] / 1e6
    row["vs_eager"] = row["eager_ms"] / row["kiln_ms"]
    if "compile_ms" in row:
        row["vs_compile"] = row["compile_ms"] / row["kiln_ms"]
    return row


def launch_overhead(kernels: int = 50, calls: int = 20) -> dict:
    """Host time per kernel of a chain of `kernels` tiny element-wise operators run by
    FlowGraph.run (no CUDA graph), against the same chain replayed as a CUDA graph."""
    import kiln
    x = kiln.symbol((1024,), "float32", "cuda")
    y = x
    for _ in range(kernels):
        y = kiln.ops.add(y, 1.0)
    graph = kiln.trace_from(y, [x])
    a = torch.randn(1024, device="cuda")
    graph.run([a])
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        graph.run([a])
    torch.cuda.synchronize()
    plain = (time.perf_counter() - t0) / calls / kernels * 1e6
    captured = graph.cuda_graph([a])
    captured.run([a])
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        captured.run([a])
    torch.cuda.synchronize()
    replay = (time.perf_counter() - t0) / calls / kernels * 1e6
    return {"kernels": kernels, "plain_us_per_kernel": plain, "cuda_graph_us_per_kernel": replay}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", default="all",
                        choices=("matmul", "norm", "columns", "conv", "conv16", "skinny", "all"))
    parser.add_argument("--json", default="ops_bench.json")
    parser.add_argument("--compile", action="store_true", help="also time torch.compile's default backend")
    parser.add_argument("--quick", action="store_true", help="only the headline shapes")
    parser.add_argument("--overhead", action="store_true", help="also measure host overhead per launch")
    parser.add_argument("--level", type=int, choices=(0, 1, 2), help="tuning level of every case")
    args = parser.parse_args()
    gpu = torch.cuda.get_device_name()
    bandwidth = copy_bandwidth()
    print(f"GPU: {gpu}; torch {torch.__version__}; copy bandwidth {bandwidth:.0f} GB/s (read + write)")
    rows, extra = [], {}
    if args.overhead:
        extra["launch_overhead"] = launch_overhead()
        print(f"launch overhead: {extra['launch_overhead']}")
    for case in case_list(args.suite, args.quick, args.level):
        try:
            row = run_case(case, args.compile)
        except Exception as exc:           # report and go on: one failing case must not hide the rest
            row = {"case": case[0], "dtype": str(case[6]).replace("torch.", ""), "error": f"{type(exc).__name__}: {exc}"[:300]}
        if "kiln_gbps" in row:
            row["vs_copy_bw"] = row["kiln_gbps"] / bandwidth
        rows.append(row)
        print(format_row(row), flush=True)
    with open(args.json, "w") as f:
        json.dump({"gpu": gpu, "torch": torch.__version__, "copy_gbps": bandwidth, **extra, "rows": rows}, f, indent=1)


def format_row(r: dict) -> str:
    if "error" in r:
        return f"{r['case']:<40} {r['dtype']:<9} ERROR {r['error']}"
    perf = (f"{r['kiln_tflops']:7.1f} TF/s vs {r['eager_tflops']:7.1f}" if "kiln_tflops" in r
            else f"{r['kiln_gbps']:7.0f} GB/s vs {r['eager_gbps']:7.0f} ({r['vs_copy_bw']:.0%} of copy)")
    comp = f" compile {r['compile_ms']:.3f}ms x{r['vs_compile']:.2f}" if "compile_ms" in r else ""
    return (f"{r['case']:<40} {r['dtype']:<9} L{r['tune_level']} kiln {r['kiln_ms']:8.3f}ms eager {r['eager_ms']:8.3f}ms "
            f"x{r['vs_eager']:.2f} {perf}{comp} err {r['rel_err']:.1e} build {r['build_s']}s")


if __name__ == "__main__":
    main()
