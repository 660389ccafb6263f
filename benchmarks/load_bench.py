"""Saved models: time from `kiln.load` to the first output, in a fresh process (issue 35).

For each model (models_bench's cases), a first process compiles it with Kiln, runs it, saves it
with `kiln.save` and writes its inputs and output beside the file. A second, fresh process with an
empty kernel cache then reports:

- `import_s`: `import torch, kiln`, and `cuda_init_s`: the CUDA context's creation (both paid by
  any process that runs a model on the GPU, compiled or not);
- `load_s`: `kiln.load` (the manifest's check, unpickling, nothing run yet);
- `first_output_s`: the first call, its result waited for (kernels mapped from the file, the CUDA
  graph captured);
- `load_to_first_output_s`: the two together, the figure issue 35 bounds at 0.5 s;
- `max_abs_diff`: the loaded model's output against the saved model's on the same inputs, and
  `kernel_builds`: the kernels the load compiled (the log's cache misses; 0 expected);
- `tampered_refused` / `other_architecture_refused`: a copy of the file with one byte of a part
  changed, and one whose manifest names another GPU, each refused with a `LoadError`.

    python benchmarks/load_bench.py [--models resnet50_b32] [--device cuda] [--dtype float16]
        [--repeats 3] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent

SAVE = """
import sys, torch, kiln
sys.path.insert(0, {here!r})
from models_bench import CASES
from kernel_counts import randomize_batch_norm
name, device, dtype, path, io = sys.argv[1:6]
torch.manual_seed(0)
model, make_inputs = CASES[name]()
randomize_batch_norm(model)
model = model.eval().to(device, getattr(torch, dtype))
inputs = tuple(x.to(device) for x in make_inputs(getattr(torch, dtype)))
compiled = torch.compile(model, backend="kiln")
with torch.no_grad():
    for _ in range(3):
        out = compiled(*inputs)
kiln.save(compiled, path)
torch.save({{"inputs": inputs, "output": out}}, io)
"""

LOAD = """
import json, sys, time
start = time.perf_counter()
import torch, kiln
from kiln.frontend.torch.persist import LoadError
imported = time.perf_counter()
path, io, device, tampered, foreign = sys.argv[1:6]
if device == "cuda":
    torch.cuda.init()
    torch.empty(1, device=device)
    torch.cuda.synchronize()
ready = time.perf_counter()
loaded = kiln.load(path)
after_load = time.perf_counter()
saved = torch.load(io)
inputs = saved["inputs"]
read_inputs = time.perf_counter()
with torch.no_grad():
    out = loaded(*inputs)
if device == "cuda":
    torch.cuda.synchronize()
first = time.perf_counter()
refused = {{}}
for label, other in (("tampered_refused", tampered), ("other_architecture_refused", foreign)):
    try:
        kiln.load(other)
        refused[label] = "loaded"
    except LoadError as error:
        refused[label] = str(error)[:300]
print("RESULT " + json.dumps({{
    "import_s": imported - start, "cuda_init_s": ready - imported, "load_s": after_load - ready,
    "first_output_s": first - read_inputs,
    "load_to_first_output_s": (after_load - ready) + (first - read_inputs),
    "max_abs_diff": (out.float() - saved["output"].float()).abs().max().item(), **refused}}))
"""


def _python(script: str, *args, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", script, *map(str, args)], capture_output=True,
                          text=True, timeout=900, env={**os.environ, **env})


def _copy_with(path: Path, target: Path, change) -> None:
    """A copy of the zip at `path` with `change(name, data) -> data` applied to each member."""
    with zipfile.ZipFile(path) as source, zipfile.ZipFile(target, "w", zipfile.ZIP_STORED) as out:
        for name in source.namelist():
            out.writestr(name, change(name, source.read(name)))


def _flip_a_byte(name: str, data: bytes) -> bytes:
    if name == "manifest.json" or not data:
        return data
    return data[:len(data) // 2] + bytes([data[len(data) // 2] ^ 1]) + data[len(data) // 2 + 1:]


def _other_gpu(name: str, data: bytes) -> bytes:
    if name != "manifest.json":
        return data
    manifest = json.loads(data)
    manifest["architecture"] = {d: ("sm_80" if d != "cpu" else a) for d, a in manifest["architecture"].items()}
    return json.dumps(manifest).encode()


def measure(name: str, device: str, dtype: str, repeats: int, folder: Path) -> dict:
    path, io = folder / f"{name}.kiln", folder / f"{name}.pt"
    saved = _python(SAVE.format(here=str(HERE)), name, device, dtype, path, io,
                    env={"KILN_CACHE_DIR": str(folder / "cache-save")})
    if saved.returncode:
        raise SystemExit(f"saving {name} failed:\n{saved.stderr[-3000:]}")
    tampered, foreign = folder / f"{name}-tampered.kiln", folder / f"{name}-sm80.kiln"
    _copy_with(path, tampered, _flip_a_byte)
    _copy_with(path, foreign, _other_gpu)
    row = {"model": name, "device": device, "dtype": dtype, "file_bytes": path.stat().st_size, "runs": []}
    for repeat in range(repeats):
        cache = folder / f"cache-load-{repeat}"
        run = _python(LOAD.format(), path, io, device, tampered, foreign,
                      env={"KILN_CACHE_DIR": str(cache), "KILN_LOG": "info"})
        if run.returncode:
            raise SystemExit(f"loading {name} failed:\n{run.stderr[-3000:]}")
        result = json.loads(next(l for l in run.stdout.splitlines() if l.startswith("RESULT "))[7:])
        result["kernel_builds"] = run.stderr.count("kernel cache miss") + run.stderr.count("stage build")
        row["runs"].append(result)
        print(name, repeat, {k: (round(v, 4) if isinstance(v, float) else v) for k, v in result.items()}, flush=True)
    best = min(row["runs"], key=lambda r: r["load_to_first_output_s"])
    row["load_to_first_output_s"] = sorted(r["load_to_first_output_s"] for r in row["runs"])[len(row["runs"]) // 2]
    row["least_load_to_first_output_s"] = best["load_to_first_output_s"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["resnet50_b32"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        rows = [measure(m, args.device, args.dtype, args.repeats, Path(folder)) for m in args.models]
    for row in rows:
        print(f"{row['model']}: load to first output {row['load_to_first_output_s']:.3f} s (median of "
              f"{len(row['runs'])}; least {row['least_load_to_first_output_s']:.3f} s), file {row['file_bytes'] / 1e6:.1f} MB")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    main()
