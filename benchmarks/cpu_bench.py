"""Latency on the CPU: eager PyTorch, torch.compile's default backend (Inductor) and Kiln.

ResNet-18 and a MobileNetV2 (224x224), ResNet-50 at batch 8, BERT-base (128 tokens,
transformers), a tiny Llama-style decoder (defined here: transformers' Llama calls
torch._C._log_api_usage_once, which Kiln does not map; 128 tokens), batch 1 unless named, random
weights, and a 1024^3 float32 matmul; in one process, at each thread count of `--threads`
(torch.set_num_threads; Kiln's kernels use the same). Each compiled model is checked against
eager before it is timed; then the backends are timed in turn, `--rounds` times over (each
round `--repeats` calls of each), so that a drift of the machine touches all alike; a time is
the median over rounds of each round's median, wall-clock and CPU time (all threads of the
process).

Other processes skew CPU timings, so each round also records the CPU time the whole machine
spent beyond this process, and the time a hypervisor gave other guests (/proc/stat), as a share
of its cores: `other_cpu_share`, the largest
over the rounds of a case. A run whose share exceeds QUIET_SHARE is marked `"quiet": false`
and is not a record.

    python benchmarks/cpu_bench.py [--cases resnet18 mobilenet_v2 resnet50_b8 bert llama matmul]
        [--backends eager inductor kiln] [--repeats 20] [--rounds 3] [--threads 1 2] [--json out.json]
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

from kernel_counts import bert_base, randomize_batch_norm, resnet50

QUIET_SHARE = 0.05     # of the machine's CPU time spent by other processes, at most, in a record


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
    "resnet50_b8": lambda: (resnet50(), (torch.randn(8, 3, 224, 224),)),
    "bert": lambda: (_Hidden(bert_base()), (torch.randint(0, 30522, (1, 128)),)),
    "llama": lambda: (TinyLlama(), (torch.randint(0, 8000, (1, 128)),)),
    "matmul": lambda: (MatMul(), (torch.randn(1024, 1024), torch.randn(1024, 1024))),
}


def _machine_busy_seconds() -> float:
    """CPU seconds all processes of the machine have spent (user, nice, system and interrupt
    time of /proc/stat), plus the time a hypervisor gave other guests (steal), or NaN where
    there is no /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()[1:]
    except OSError:
        return math.nan
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def timed(fn, inputs, repeats: int) -> tuple[float, float, float]:
    """Medians of one call's wall-clock and CPU (all threads of the process) milliseconds over
    `repeats` calls, and the share of the machine's CPU time that other processes took meanwhile."""
    wall, cpu = [], []
    machine, own, start_all = _machine_busy_seconds(), time.process_time(), time.perf_counter()
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        fn(*inputs)
        wall.append((time.perf_counter() - start) * 1e3)
        cpu.append((time.process_time() - start_cpu) * 1e3)
    elapsed = time.perf_counter() - start_all
    other = (_machine_busy_seconds() - machine) - (time.process_time() - own)
    return statistics.median(wall), statistics.median(cpu), max(0.0, other) / (elapsed * os.cpu_count())


def relative_error(got, want) -> float:
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def run_case(name: str, backends: list[str], repeats: int, rounds: int) -> dict:
    torch.manual_seed(0)
    model, inputs = CASES[name]()
    randomize_batch_norm(model)
    model.eval()
    row = {"case": name, "threads": torch.get_num_threads()}
    with torch.no_grad():
        expected = model(*inputs)
        torch._dynamo.reset()
        fns = {}
        # no reset between backends: dynamo keeps each backend's graphs under a guard on the backend
        for backend in backends:
            fn = fns[backend] = model if backend == "eager" else torch.compile(model, backend=backend)
            start = time.perf_counter()
            got = fn(*inputs)
            row[f"{backend}_compile_s"] = round(time.perf_counter() - start, 2)
            row[f"{backend}_rel_error"] = relative_error(got, expected)
            for _ in range(3):
                fn(*inputs)
        samples = {backend: [] for backend in backends}
        for _ in range(rounds):
            for backend, fn in fns.items():
                samples[backend].append(timed(fn, inputs, repeats))
    row["other_cpu_share"] = round(max(s[2] for runs in samples.values() for s in runs), 4)
    row["quiet"] = row["other_cpu_share"] <= QUIET_SHARE
    for backend, runs in samples.items():
        wall, cpu = statistics.median(s[0] for s in runs), statistics.median(s[1] for s in runs)
        row[f"{backend}_ms"], row[f"{backend}_cpu_ms"] = round(wall, 3), round(cpu, 3)
        row[f"{backend}_rounds_ms"] = [round(s[0], 3) for s in runs]
        print(f"{name:13s} {row['threads']} thr {backend:9s} {wall:9.2f} ms  CPU {cpu:9.2f} ms  "
              f"(first call {row[f'{backend}_compile_s']} s, rel. error {row[f'{backend}_rel_error']:.1e})",
              flush=True)
    print(f"{name:13s} {row['threads']} thr  other processes took {row['other_cpu_share']:.1%} of the machine"
          f"{'' if row['quiet'] else ': NOT QUIET, not a record'}", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--backends", nargs="+", default=["eager", "inductor", "kiln"],
                        choices=["eager", "inductor", "kiln"])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, nargs="+", default=[torch.get_num_threads()],
                        help="thread counts to run at, in turn (default: torch's)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        rows += [run_case(name, args.backends, args.repeats, args.rounds) for name in args.cases]
    result = {"torch": torch.__version__, "cpu": _cpu_name(), "cores": os.cpu_count(),
              "quiet": all(r["quiet"] for r in rows), "rows": rows}
    if "kiln" in args.backends:
        for threads in args.threads:
            for other in (b for b in args.backends if b != "kiln"):
                ratios = [r[f"{other}_ms"] / r["kiln_ms"] for r in rows
                          if r["case"] != "matmul" and r["threads"] == threads]
                if ratios:
                    print(f"{threads} thread(s): Kiln vs {other}, geometric mean over models: "
                          f"{math.prod(ratios) ** (1 / len(ratios)):.2f}x")
    print("quiet machine: a record" if result["quiet"] else "NOT QUIET: other processes took CPU time; not a record")
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
