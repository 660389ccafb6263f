"""Compile time on the CPU: a model's first compiled call, each in a fresh process.

For each model, the time of the first call of `torch.compile(model, backend=...)` (dynamo's
trace, the backend's compile, one run), each measured in a new Python process:

- `eager`: torch.compile(backend="eager"), dynamo's trace alone (the floor);
- `kiln-cold`: Kiln with empty caches;
- `kiln-kernels`: Kiln with its kernel cache warm and the whole-graph cache off (KILN_GRAPH_CACHE=0):
  mapping, passes, scheduling and rendering run again, the kernels are not rebuilt;
- `kiln-warm`: Kiln with both caches warm: the whole-graph cache's hit;
- `inductor-cold`, `inductor-warm` (with `--inductor`): torch.compile's default backend with its
  caches in a fresh folder, then warm.

Each measurement is repeated (`--repeats`, a fresh cold cache each time) and the least time
kept (other processes only add time). For Kiln, the time its backend spent compiling the
graph (`KilnFunction._compile`: a hit's key, lookup and kernel loads; a miss's whole work) is
reported too, apart from dynamo's trace and the first run.
Models: a small BERT (transformers' BertModel, hidden 128, 2 layers, 32 tokens, batch 2) and
ResNet-18 (batch 1, 224x224, defined in cpu_bench.py), with random weights, inference.

    python benchmarks/compile_bench.py [--models bert resnet18] [--repeats 3] [--inductor] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent

CHILD = """
import sys, time, torch
sys.path.insert(0, {here!r})
torch.manual_seed(0)
name, backend = sys.argv[1], sys.argv[2]
if name == "bert":
    from transformers import BertConfig, BertModel
    model = BertModel(BertConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                                 intermediate_size=512, attn_implementation="eager")).eval()
    inputs = (torch.randint(0, 1000, (2, 32)),)
else:
    from cpu_bench import resnet18
    from kernel_counts import randomize_batch_norm
    model = resnet18().eval()
    randomize_batch_norm(model)
    inputs = (torch.randn(1, 3, 224, 224),)
inside = [0.0]
if backend == "kiln":
    from kiln.frontend.torch.backend import KilnFunction
    original = KilnFunction._compile

    def timed(self, args):
        start = time.perf_counter()
        try:
            return original(self, args)
        finally:
            inside[0] += time.perf_counter() - start
    KilnFunction._compile = timed
compiled = torch.compile(model, backend=backend)
start = time.perf_counter()
with torch.no_grad():
    compiled(*inputs)
print(time.perf_counter() - start, inside[0])
"""


def first_call(model: str, backend: str, env: dict) -> tuple[float, float]:
    """Seconds of the first compiled call of `model` with `backend`, in a fresh process, and of
    Kiln's compile within it (0 for other backends)."""
    out = subprocess.run([sys.executable, "-c", CHILD.format(here=str(HERE)), model, backend],
                         capture_output=True, text=True, env={**os.environ, **env}, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"{model} with {backend} failed:\n{out.stderr}")
    call, inside = out.stdout.strip().splitlines()[-1].split()
    return float(call), float(inside)


def measure(model: str, repeats: int, inductor: bool) -> dict:
    """The least seconds of each measurement of the module's docstring for `model`."""
    times: dict[str, list[float]] = {}
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as folder:
            kiln = {"KILN_CACHE_DIR": f"{folder}/kiln", "KILN_GRAPH_CACHE": "1"}
            inductor_env = {"TORCHINDUCTOR_CACHE_DIR": f"{folder}/inductor"}
            runs = [("eager", "eager", {}), ("kiln-cold", "kiln", kiln),
                    ("kiln-kernels", "kiln", {**kiln, "KILN_GRAPH_CACHE": "0"}),
                    ("kiln-warm", "kiln", kiln)]
            if inductor:
                runs += [("inductor-cold", "inductor", inductor_env), ("inductor-warm", "inductor", inductor_env)]
            for label, backend, env in runs:
                call, inside = first_call(model, backend, env)
                times.setdefault(label, []).append(call)
                if backend == "kiln":
                    times.setdefault(f"{label} (Kiln's compile)", []).append(inside)
    result = {label: min(t) for label, t in times.items()}
    result["kiln-warm beyond eager"] = result["kiln-warm"] - result["eager"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["bert", "resnet18"], choices=["bert", "resnet18"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--inductor", action="store_true", help="also time Inductor, cold and warm")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    result = {"load average": os.getloadavg()[0],
              "models": {m: measure(m, args.repeats, args.inductor) for m in args.models}}
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
