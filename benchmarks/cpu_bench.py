"""Latency on the CPU: eager PyTorch, torch.compile's default backend (Inductor) and Kiln.

ResNet-18 and a MobileNetV2 (224x224), BERT-base (128 tokens, transformers), a tiny Llama-style
decoder (defined here: transformers' Llama calls torch._C._log_api_usage_once, which Kiln does
not map; 128 tokens), all at batch 1 with random weights, and a 1024^3 float32 matmul, in one process
with torch's thread count (torch.get_num_threads(); Kiln's kernels use the same). Each compiled
model is checked against eager before it is timed. Times are medians of wall-clock timings of
single calls after warm-up; the machine's load average is recorded, since other processes
skew CPU timings.

    python benchmarks/cpu_bench.py [--cases resnet18 mobilenet_v2 bert llama matmul]
        [--backends eager inductor kiln] [--repeats 20] [--threads N] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time

import torch
import torch.nn as nn

from kernel_counts import bert_base, randomize_batch_norm


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(),
            nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout))
        self.skip = nn.Identity() if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        return torch.relu(self.body(x) + self.skip(x))


def resnet18() -> nn.Module:
    """torchvision's ResNet-18 architecture, defined here (torchvision is not required)."""
    layers, cin = [], 64
    for width, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [BasicBlock(cin, width, stride), BasicBlock(width, width, 1)]
        cin = width
    return nn.Sequential(
        nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(3, 2, 1),
        *layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, 1000))


class InvertedResidual(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, expand: int):
        super().__init__()
        hidden = cin * expand
        layers = [] if expand == 1 else [nn.Conv2d(cin, hidden, 1, bias=False), nn.BatchNorm2d(hidden), nn.ReLU6()]
        layers += [nn.Conv2d(hidden, hidden, 3, stride, 1, groups=hidden, bias=False), nn.BatchNorm2d(hidden),
                   nn.ReLU6(), nn.Conv2d(hidden, cout, 1, bias=False), nn.BatchNorm2d(cout)]
        self.body = nn.Sequential(*layers)
        self.residual = stride == 1 and cin == cout

    def forward(self, x):
        return x + self.body(x) if self.residual else self.body(x)


def mobilenet_v2() -> nn.Module:
    """torchvision's MobileNetV2 architecture (width 1.0), defined here."""
    layers, cin = [nn.Conv2d(3, 32, 3, 2, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU6()], 32
    for expand, cout, repeats, stride in ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2),
                                          (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1)):
        for k in range(repeats):
            layers.append(InvertedResidual(cin, cout, stride if k == 0 else 1, expand))
            cin = cout
    layers += [nn.Conv2d(cin, 1280, 1, bias=False), nn.BatchNorm2d(1280), nn.ReLU6(),
               nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(1280, 1000)]
    return nn.Sequential(*layers)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class LlamaBlock(nn.Module):
    """Pre-norm decoder layer: causal attention with rotary embeddings and grouped key-value
    heads, then a SwiGLU feed-forward."""

    def __init__(self, dim: int, heads: int, kv_heads: int, hidden: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.q = nn.Linear(dim, dim, bias=False)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)
        self.gate_up = nn.Linear(dim, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)
        self.norm1, self.norm2 = RMSNorm(dim), RMSNorm(dim)

    @staticmethod
    def rotate(x, cos, sin):
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin

    def forward(self, x, cos, sin, mask):
        b, t, dim = x.shape
        h = self.norm1(x)
        q = self.q(h).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(h).view(b, t, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = self.rotate(q, cos, sin), self.rotate(k, cos, sin)
        repeat = self.heads // self.kv_heads
        k, v = k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1)
        att = torch.softmax(q @ k.transpose(-1, -2) / self.head_dim ** 0.5 + mask, -1)
        x = x + self.o((att @ v).transpose(1, 2).reshape(b, t, dim))
        gate, up = self.gate_up(self.norm2(x)).chunk(2, -1)
        return x + self.down(nn.functional.silu(gate) * up)


class TinyLlama(nn.Module):
    """A Llama-style decoder (defined here): 4 layers, hidden 512, 8 heads (2 key-value heads),
    SwiGLU 1376, vocabulary 8000, 128 positions; returns logits."""

    def __init__(self, vocab: int = 8000, dim: int = 512, layers: int = 4, heads: int = 8, kv_heads: int = 2,
                 hidden: int = 1376, positions: int = 128):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(LlamaBlock(dim, heads, kv_heads, hidden) for _ in range(layers))
        self.norm, self.head = RMSNorm(dim), nn.Linear(dim, vocab, bias=False)
        half = dim // heads // 2
        angles = torch.arange(positions)[:, None] * 10000.0 ** (-torch.arange(half) / half)
        self.register_buffer("cos", torch.cat((angles.cos(), angles.cos()), -1))
        self.register_buffer("sin", torch.cat((angles.sin(), angles.sin()), -1))
        self.register_buffer("mask", torch.full((positions, positions), float("-inf")).triu(1))

    def forward(self, ids):
        t = ids.shape[1]
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x, self.cos[:t], self.sin[:t], self.mask[:t, :t])
        return self.head(self.norm(x))


class MatMul(nn.Module):
    def forward(self, a, b):
        return a @ b


class _Hidden(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(ids).last_hidden_state


CASES = {
    "resnet18": lambda: (resnet18(), (torch.randn(1, 3, 224, 224),)),
    "mobilenet_v2": lambda: (mobilenet_v2(), (torch.randn(1, 3, 224, 224),)),
    "bert": lambda: (_Hidden(bert_base()), (torch.randint(0, 30522, (1, 128)),)),
    "llama": lambda: (TinyLlama(), (torch.randint(0, 8000, (1, 128)),)),
    "matmul": lambda: (MatMul(), (torch.randn(1024, 1024), torch.randn(1024, 1024))),
}


def timed(fn, inputs, repeats: int) -> tuple[float, float]:
    """Medians of one call's wall-clock and CPU (all threads of the process) milliseconds,
    after warm-up. On a machine shared with other processes the CPU time of a one-thread run
    is the steadier measure."""
    for _ in range(3):
        fn(*inputs)
    wall, cpu = [], []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        fn(*inputs)
        wall.append((time.perf_counter() - start) * 1e3)
        cpu.append((time.process_time() - start_cpu) * 1e3)
    return statistics.median(wall), statistics.median(cpu)


def relative_error(got, want) -> float:
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def run_case(name: str, backends: list[str], repeats: int) -> dict:
    torch.manual_seed(0)
    model, inputs = CASES[name]()
    randomize_batch_norm(model)
    model.eval()
    row = {"case": name}
    with torch.no_grad():
        expected = model(*inputs)
        for backend in backends:
            torch._dynamo.reset()
            fn = model if backend == "eager" else torch.compile(model, backend=backend if backend == "kiln" else "inductor")
            start = time.perf_counter()
            got = fn(*inputs)
            row[f"{backend}_compile_s"] = round(time.perf_counter() - start, 2)
            row[f"{backend}_rel_error"] = relative_error(got, expected)
            wall, cpu = timed(fn, inputs, repeats)
            row[f"{backend}_ms"], row[f"{backend}_cpu_ms"] = round(wall, 3), round(cpu, 3)
            print(f"{name:13s} {backend:9s} {wall:9.2f} ms  CPU {cpu:9.2f} ms  (first call {row[f'{backend}_compile_s']} s, "
                  f"rel. error {row[f'{backend}_rel_error']:.1e})", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--backends", nargs="+", default=["eager", "inductor", "kiln"],
                        choices=["eager", "inductor", "kiln"])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    rows = [run_case(name, args.backends, args.repeats) for name in args.cases]
    result = {"threads": torch.get_num_threads(), "torch": torch.__version__, "cpu": _cpu_name(),
              "load_average_before": load_before, "load_average_after": os.getloadavg(), "rows": rows}
    print(json.dumps(result, indent=1))
    if "kiln" in args.backends and "eager" in args.backends:
        for unit in ("ms", "cpu_ms"):
            ratios = [r[f"eager_{unit}"] / r[f"kiln_{unit}"] for r in rows if r["case"] != "matmul"]
            if ratios:
                print(f"Kiln vs eager ({unit}), geometric mean over models: "
                      f"{math.prod(ratios) ** (1 / len(ratios)):.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


if __name__ == "__main__":
    main()
