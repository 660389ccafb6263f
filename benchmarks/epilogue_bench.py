"""What a fused epilogue costs a GEMM: BERT-base's linears with a bias only, with a residual add
and with GELU, Kiln's one fused kernel against cuBLAS plus PyTorch's separate kernel.

Each case is a small module compiled by Kiln (CUDA graphs off); its kernels are timed in place
as replays of a CUDA graph of repeated calls (`kernel_times.time_steps`), and eager PyTorch's
whole call the same way. The bias-only row of each shape is the baseline: the difference to it
is the epilogue's cost.

    python benchmarks/epilogue_bench.py [--batch-rows 1024] [--dtype float16] [--json out.json]
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from kernel_times import _graph_time, describe, graph_runs, time_steps


class Bias(torch.nn.Module):
    def __init__(self, k, n):
        super().__init__()
        self.linear = torch.nn.Linear(k, n)

    def forward(self, x, residual):
        return self.linear(x)


class Residual(Bias):
    def forward(self, x, residual):
        return self.linear(x) + residual


class Gelu(Bias):
    def forward(self, x, residual):
        return F.gelu(self.linear(x))


SHAPES = [(768, 768), (3072, 768), (768, 3072)]     # (K, N): attention output, FFN down, FFN up
EPILOGUES = {"bias": Bias, "bias+residual": Residual, "bias+gelu": Gelu}


def main() -> None:
    import kiln
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-rows", type=int, default=1024, help="M: batch x sequence (BERT b8: 1024)")
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--json", help="write the rows to this file")
    args = parser.parse_args()
    kiln.torch.dynamo_config.use_cuda_graph(False)
    dtype, m = getattr(torch, args.dtype), args.batch_rows
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    rows = []
    for k, n in SHAPES:
        for label, make in EPILOGUES.items():
            torch.manual_seed(0)
            module = make(k, n).to("cuda", dtype).eval()
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            residual = torch.randn(m, n, device="cuda", dtype=dtype)
            torch._dynamo.reset()
            compiled = torch.compile(module, backend="kiln")
            with torch.no_grad():
                torch.testing.assert_close(compiled(x, residual), module(x, residual), atol=5e-2, rtol=5e-2)
                steps = []
                for graph, inputs in graph_runs(lambda: compiled(x, residual)):
                    steps += [dict(describe(s), us=us) for s, us in zip(graph.steps, time_steps(graph, inputs))]
                eager_us = _graph_time(lambda: module(x, residual), 20)
            kiln_us = sum(s["us"] for s in steps)
            row = {"shape": f"{m}x{k}x{n}", "epilogue": label, "kiln_us": kiln_us, "eager_us": eager_us,
                   "kiln_kernels": [name for s in steps for name in s["kernels"]]}
            rows.append(row)
            print(f"{row['shape']:>16} {label:<14} kiln {kiln_us:7.2f} us ({len(steps)} kernels)   "
                  f"eager {eager_us:7.2f} us   ratio {eager_us / kiln_us:5.2f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
