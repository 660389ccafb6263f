"""Compile time: a model's first compiled call, each in a fresh process.

For each model, the time of the first call of `torch.compile(model, backend=...)` (dynamo's
trace, the backend's compile, one run), each measured in a new Python process:

- `eager`: torch.compile(backend="eager"), dynamo's trace alone (the floor);
- `kiln-cold`: Kiln with empty caches;
- `kiln-kernels`: Kiln with its kernel cache warm and the whole-graph cache off (KILN_GRAPH_CACHE=0):
  mapping, passes, scheduling and rendering run again, the kernels are not rebuilt;
- `kiln-warm`: Kiln with both caches warm: the whole-graph cache's hit;
- `inductor-cold`, `inductor-warm` (with `--inductor`): torch.compile's default backend with its
  caches in a fresh folder, then warm.

For Kiln, the time its backend spent compiling the graph (`KilnFunction._compile`: a hit's key,
lookup and kernel loads; a miss's whole work) is reported too, apart from dynamo's trace and the
first run, and for `kiln-warm` its parts (`PARTS`, timed around the functions named there; a
part whose function the code under test lacks is left out): the handover (`kiln_backend`, when
dynamo hands the graph over: the unmapped-operator check and the plugins' loading it needs, or
the graph cache's look for an entry), then within the compile the key, the entry's read (with
its checksum) and unpickling, the check of the values of the constants the compile read, the
kernels' loading, the preparation of constants laid out once for their kernels, and the rest;
`Kiln's own` is the handover and the compile together.

Each measurement is repeated (`--repeats`, a fresh cold cache each time); the median and the
least of each are reported, with the machine's load average before and after (other processes
only add time). `--trees LABEL=PYTHONPATH ...` measures several checkouts of Kiln (before and
after a change) in turn within each repeat, each with caches of its own, so that a drift of the
machine touches all alike. `--warm-only` times `eager` and `kiln-warm` alone: each tree's caches
are filled once (a cold compile, untimed), then each repeat times the eager backend's first call
and each tree's warm hit in turn.
Models, with random weights, inference: a small BERT (transformers' BertModel, hidden 128,
2 layers, 32 tokens, batch 2), a GPT-2-shaped model (transformers' GPT2Model, width 128,
2 layers, 32 tokens, batch 1) and ResNet-18 (batch 1, 224x224, defined in cpu_bench.py), on the
CPU in float32 by default; with `--suite`, models_bench's cases instead (`resnet50_b32`,
`bert_b8`, `gpt2`, `llama_1b`, ...), e.g. with `--device cuda --dtype float16` as issue 35
measures them on a GPU (Inductor in its default mode; the first call waits for the GPU).

    python benchmarks/compile_bench.py [--models bert gpt2 resnet18] [--repeats 3] [--inductor]
        [--suite] [--device cpu|cuda] [--dtype float32|float16|bfloat16]
        [--trees before=PATH after=PATH] [--warm-only] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent

PARTS = {
    "handover": [("kiln.frontend.torch.backend", "kiln_backend")],
    "key": [("kiln.frontend.torch.graph_cache", "key")],
    "lookup": [("kiln.frontend.torch.graph_cache", "lookup")],
    "read entry": [("kiln.runtime.cache", "read_entry")],
    "unpickle": [("kiln.frontend.torch.packed_entry", "loads"), ("kiln.frontend.torch.graph_cache", "loads")],
    "values check": [("kiln.frontend.torch.graph_cache", "_values_digest")],
    "assemble": [("kiln.runtime.plan", "Plan.assemble")],
    "kernel loading": [("kiln.runtime.plan", "Plan.load_kernels")],
}
"""Parts of Kiln's compile timed in the child: label -> where its function may be, as (module,
attribute path), the first found timed (code before and after a change names some otherwise)."""

SMALL = ("bert", "gpt2", "resnet18")
"""The small CPU models, defined in CHILD (`--suite`: models_bench's cases instead)."""

CHILD = """
import importlib, json, sys, time, torch
sys.path.insert(0, {here!r})
torch.manual_seed(0)
name, backend, parts, device, dtype, suite = sys.argv[1:7]
parts, dtype, suite = json.loads(parts), getattr(torch, dtype), suite == "suite"
if not suite and dtype != torch.float32:
    raise SystemExit("the small models run in float32 only")
if suite:
    from models_bench import CASES
    model, make_inputs = CASES[name]()
    model, inputs = model.eval().to(device, dtype), tuple(x.to(device) for x in make_inputs(dtype))
elif name == "bert":
    from transformers import BertConfig, BertModel
    model = BertModel(BertConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                                 intermediate_size=512, attn_implementation="eager")).eval()
    inputs = (torch.randint(0, 1000, (2, 32)),)
elif name == "gpt2":
    from transformers import GPT2Config, GPT2Model
    model = GPT2Model(GPT2Config(n_embd=128, n_layer=2, n_head=2, n_positions=128, vocab_size=1000,
                                 bos_token_id=0, eos_token_id=0, use_cache=False,
                                 attn_implementation="eager")).eval()
    inputs = (torch.randint(0, 1000, (1, 32)),)
else:
    from cpu_bench import resnet18
    from kernel_counts import randomize_batch_norm
    model = resnet18().eval()
    randomize_batch_norm(model)
    inputs = (torch.randn(1, 3, 224, 224),)
if not suite:
    model, inputs = model.to(device), tuple(x.to(device) for x in inputs)
spent = {{}}


def timed(label, function):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            spent[label] = spent.get(label, 0.0) + time.perf_counter() - start
    return wrapper


def place(module, path):
    # the object holding the attribute at `path` of `module` and its name (None: the code has neither)
    try:
        owner = importlib.import_module(module)
    except ImportError:
        return None, None
    *outer, attribute = path.split(".")
    for step in outer:
        owner = getattr(owner, step, None)
    return (owner, attribute) if hasattr(owner, attribute) else (None, None)


if backend == "kiln":
    parts["compile"] = [["kiln.frontend.torch.backend", "KilnFunction._compile"]]
    for label, places in parts.items():
        for module, path in places:
            owner, attribute = place(module, path)
            if owner is not None:
                setattr(owner, attribute, timed(label, getattr(owner, attribute)))
                break
compiled = torch.compile(model, backend=backend)
start = time.perf_counter()
with torch.no_grad():
    compiled(*inputs)
if device == "cuda":
    torch.cuda.synchronize()
spent["call"] = time.perf_counter() - start
print(json.dumps(spent))
"""


DEVICE = ("cpu", "float32", "small")
"""The device, dtype and models ("small" or "suite") of the children (`--device`, `--dtype`, `--suite`)."""


def first_call(model: str, backend: str, env: dict) -> dict[str, float]:
    """Seconds of the first compiled call of `model` with `backend` in a fresh process
    (`call`), and for Kiln of its compile (`compile`) and of each of its PARTS that ran."""
    out = subprocess.run([sys.executable, "-c", CHILD.format(here=str(HERE)), model, backend,
                          json.dumps(PARTS), *DEVICE],
                         capture_output=True, text=True, env={**os.environ, **env}, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"{model} with {backend} failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def breakdown(spent: dict[str, float]) -> dict[str, float]:
    """A warm compile's parts (`first_call`'s times) as the module's docstring lists them."""
    parts = {label: spent[label] for label in ("handover", "key", "read entry", "unpickle", "values check",
                                               "kernel loading") if label in spent}
    parts["Kiln's own"] = spent["handover"] + spent["compile"]
    if "assemble" in spent:
        parts["constant preparation"] = spent["assemble"] - spent.get("kernel loading", 0.0)
    if "lookup" in spent:
        parts["other lookup"] = spent["lookup"] - sum(spent.get(k, 0.0) for k in ("read entry", "unpickle",
                                                                                   "values check"))
    parts["the rest"] = spent["compile"] - sum(spent.get(k, 0.0) for k in ("key", "lookup", "assemble"))
    return parts


def measure(model: str, repeats: int, inductor: bool, trees: dict[str, str | None], warm_only: bool = False) -> dict:
    """The median and least seconds of each measurement of the module's docstring for `model`,
    for each checkout of Kiln in `trees` (label -> PYTHONPATH, None: this process's); with
    `warm_only`, those of `measure_warm`."""
    if warm_only:
        return measure_warm(model, repeats, trees)
    times: dict[str, dict[str, list[float]]] = {tree: {} for tree in trees}
    for _ in range(repeats):
        for tree, path in trees.items():
            found = times[tree]
            with tempfile.TemporaryDirectory() as folder:
                kiln = _kiln_env(f"{folder}/kiln", path)
                inductor_env = {"TORCHINDUCTOR_CACHE_DIR": f"{folder}/inductor"}
                runs = [("eager", "eager", {}), ("kiln-cold", "kiln", kiln),
                        ("kiln-kernels", "kiln", {**kiln, "KILN_GRAPH_CACHE": "0"}),
                        ("kiln-warm", "kiln", kiln)]
                if inductor:
                    runs += [("inductor-cold", "inductor", inductor_env),
                             ("inductor-warm", "inductor", inductor_env)]
                for label, backend, env in runs:
                    spent = first_call(model, backend, env)
                    found.setdefault(label, []).append(spent["call"])
                    if backend == "kiln":
                        found.setdefault(f"{label} (Kiln's compile)", []).append(spent["compile"])
                    if label == "kiln-warm":
                        _add_parts(found, spent)
                found.setdefault("kiln-warm beyond eager", []).append(found["kiln-warm"][-1] - found["eager"][-1])
    return _medians(times)


def measure_warm(model: str, repeats: int, trees: dict[str, str | None]) -> dict:
    """`measure`'s `eager`, `kiln-warm` and `kiln-warm beyond eager` rows alone: each tree's
    caches filled once, then in each repeat the eager backend's first call and each tree's warm
    hit in turn."""
    times: dict[str, dict[str, list[float]]] = {tree: {} for tree in trees}
    with tempfile.TemporaryDirectory() as folder:
        envs = {tree: _kiln_env(f"{folder}/{tree}", path) for tree, path in trees.items()}
        for env in envs.values():
            first_call(model, "kiln", env)
        for _ in range(repeats):
            eager = first_call(model, "eager", {})["call"]
            for tree, env in envs.items():
                spent = first_call(model, "kiln", env)
                found = times[tree]
                found.setdefault("eager", []).append(eager)
                found.setdefault("kiln-warm", []).append(spent["call"])
                found.setdefault("kiln-warm beyond eager", []).append(spent["call"] - eager)
                _add_parts(found, spent)
    return _medians(times)


def _kiln_env(cache_dir: str, path: str | None) -> dict[str, str]:
    """The environment of a Kiln child with its caches in `cache_dir`, importing Kiln from
    `path` (a PYTHONPATH; None: this process's)."""
    env = {"KILN_CACHE_DIR": cache_dir, "KILN_GRAPH_CACHE": "1"}
    return env if path is None else {**env, "PYTHONPATH": path}


def _add_parts(found: dict[str, list[float]], spent: dict[str, float]) -> None:
    """A warm hit's parts (`breakdown`) appended to the lists of `found`."""
    for part, seconds in breakdown(spent).items():
        found.setdefault(f"kiln-warm: {part}", []).append(seconds)


def _medians(times: dict[str, dict[str, list[float]]]) -> dict:
    """The median and least of each list of seconds, per tree."""
    return {tree: {label: {"median": statistics.median(t), "least": min(t)} for label, t in found.items()}
            for tree, found in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    from models_bench import CASES
    parser.add_argument("--models", nargs="+", default=list(SMALL), choices=sorted({*SMALL, *CASES}),
                        help="the small CPU models, or with --suite models_bench's cases")
    parser.add_argument("--suite", action="store_true", help="models_bench's cases, not the small models")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--inductor", action="store_true", help="also time Inductor, cold and warm")
    parser.add_argument("--trees", nargs="+", metavar="LABEL=PYTHONPATH",
                        help="checkouts of Kiln to measure in turn (default: this process's)")
    parser.add_argument("--warm-only", action="store_true", help="time the eager backend and Kiln's warm hit alone (caches filled once)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    trees = dict(t.split("=", 1) for t in args.trees) if args.trees else {"kiln": None}
    global DEVICE
    wrong = [m for m in args.models if m not in (CASES if args.suite else SMALL)]
    if wrong:
        parser.error(f"{wrong}: not " + ("models_bench's cases" if args.suite else f"small models {SMALL} (--suite?)"))
    DEVICE = (args.device, args.dtype, "suite" if args.suite else "small")
    result = {"load average before": os.getloadavg()[0], "device": args.device, "dtype": args.dtype,
              "models": {m: measure(m, args.repeats, args.inductor, trees, args.warm_only) for m in args.models},
              "load average after": os.getloadavg()[0]}
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
