"""Sorting and scattering on a CUDA GPU: Kiln's `sort_bitonic` and `scatter_atomic` templates
against PyTorch eager in the same run.

Times are medians of CUDA-graph replays (`ops_bench.device_time_ms`), inputs rotated over
enough copies to exceed the L2 cache; each case first checks Kiln's first output against
PyTorch's. Prints a table (x > 1: Kiln faster) and writes it as JSON.

    python benchmarks/sort_scatter_bench.py --json sort_scatter.json
"""
from __future__ import annotations

import argparse
import json
import os

import torch

from ops_bench import L2_BYTES, device_time_ms, kiln_callable


def cases() -> list[tuple]:
    """(name, kiln operator, make() -> arguments, torch function of the same arguments, tolerance)."""
    logits = lambda: torch.randn(64, 32000, device="cuda")
    out = []
    for dt in (torch.float32, torch.bfloat16):
        out += [
            (f"sort (64, 32000) {dt}", "sort", lambda dt=dt: [logits().to(dt), -1], lambda x, d: torch.sort(x, d), 0),
            (f"topk 50 of (64, 32000) {dt}", "topk", lambda dt=dt: [logits().to(dt), 50], torch.topk, 0),
        ]
    out += [
        ("argsort (8192, 100)", "argsort", lambda: [torch.randn(8192, 100, device="cuda"), -1],
         lambda x, d: torch.sort(x, dim=d, stable=True).indices, 0),
        ("sort (4096, 2048) dim 0", "sort", lambda: [torch.randn(4096, 2048, device="cuda"), 0],
         lambda x, d: torch.sort(x, d), 0),
        ("median (1024, 1001)", "median", lambda: [torch.randn(1024, 1001, device="cuda"), -1], torch.median, 0),
    ]
    for dt in (torch.float32, torch.bfloat16):
        ids = lambda: torch.randint(0, 32000, (8192,), device="cuda")
        out += [
            (f"index_add (32000, 1024) <- 8192 rows {dt}", "index_add",
             lambda dt=dt: [torch.randn(32000, 1024, device="cuda").to(dt), 0, ids(),
                            torch.randn(8192, 1024, device="cuda").to(dt)],
             lambda x, d, i, s: x.index_add(d, i, s), 1e-2),
            (f"index_put accumulate (32000, 1024) <- 8192 rows {dt}", "index_put",
             lambda dt=dt: [torch.zeros(32000, 1024, device="cuda").to(dt), [ids()],
                            torch.randn(8192, 1024, device="cuda").to(dt), True],
             lambda x, i, v, a: x.index_put(tuple(i), v, accumulate=a), 1e-2),
        ]
    out.append(("scatter_add hot spots (16, 4096) <- (16384, 4096)", "scatter_add",
                lambda: [torch.randn(16, 4096, device="cuda"), 0, torch.randint(0, 16, (16384, 4096), device="cuda"),
                         torch.randn(16384, 4096, device="cuda")],
                lambda x, d, i, s: x.scatter_add(d, i, s), 1e-3))
    return out


def _tensors(args) -> list[torch.Tensor]:
    return [t for a in args for t in (a if isinstance(a, list) else [a]) if isinstance(t, torch.Tensor)]


def _with(args, tensors):
    """`args` with its tensors replaced, in order, by `tensors`."""
    it = iter(tensors)
    return [[next(it) for _ in a] if isinstance(a, list) else next(it) if isinstance(a, torch.Tensor) else a
            for a in args]


def run(case) -> dict:
    name, op, make, torch_fn, tol = case
    os.environ.setdefault("KILN_TUNE_LEVEL", "0")
    args = make()
    tensors = _tensors(args)
    size = sum(t.numel() * t.element_size() for t in tensors)
    copies = max(1, min(8, L2_BYTES // max(size, 1)))
    sets = [tensors] + [[t.clone() for t in tensors] for _ in range(copies - 1)]
    kiln_fn = kiln_callable(op, args, {})
    got = kiln_fn(tensors)[0]
    expected = torch_fn(*args)
    expected = expected[0] if isinstance(expected, tuple) else expected
    scale = expected.double().abs().max().item() or 1.0
    torch.testing.assert_close(got.double(), expected.double(), atol=tol * scale, rtol=tol)
    row = {"case": name, "kiln_ms": device_time_ms(lambda k: kiln_fn(sets[k]), copies),
           "eager_ms": device_time_ms(lambda k: torch_fn(*_with(args, sets[k])), copies)}
    row["vs_eager"] = row["eager_ms"] / row["kiln_ms"]
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default="sort_scatter_bench.json")
    args = parser.parse_args()
    print(f"GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}")
    rows = []
    for case in cases():
        try:
            row = run(case)
            print(f"{row['case']:<58} kiln {row['kiln_ms']:8.3f}ms eager {row['eager_ms']:8.3f}ms x{row['vs_eager']:.2f}",
                  flush=True)
        except Exception as exc:           # report and go on: one failing case must not hide the rest
            row = {"case": case[0], "error": f"{type(exc).__name__}: {exc}"[:300]}
            print(f"{case[0]:<58} ERROR {row['error']}", flush=True)
        rows.append(row)
    with open(args.json, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
