"""Same-process A/B of Kiln trees on a CPU model: each tree's compiled model saved by `kiln.save`, then
all loaded into one process and timed in interleaved rounds, so that a drift of a shared machine
touches every tree alike.

Step 1, once per tree, with that tree's Kiln on PYTHONPATH (the whole-graph cache off, so that the
tree compiles its own kernels):

    PYTHONPATH=<tree>/core:<tree>/ops_builtin:... python benchmarks/cpu_tree_ab.py save before.kiln [--case resnet50_b8]

Step 2, with any tree (loading runs no compiler; every model goes through `kiln.load`, so none pays
dynamo's guards and the others not):

    python benchmarks/cpu_tree_ab.py compare before=before.kiln after=after.kiln [--case resnet50_b8]
        [--threads 1] [--rounds 10] [--repeats 3]

`compare` checks each model against eager, then prints per tree the minimum and median wall-clock
and CPU milliseconds of a call over all rounds, each tree's median against the first's, and the
load average before and after (`cpu_bench.py` tells how busy a machine may be for a record).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from cpu_bench import CASES, relative_error
from kernel_counts import randomize_batch_norm


def _model(case: str):
    torch.manual_seed(0)
    model, inputs = CASES[case]()
    randomize_batch_norm(model)
    return model.eval(), inputs


def save(case: str, path: str) -> None:
    """Compile `case` with the Kiln on the path and save it to `path`."""
    import kiln
    from kiln.frontend.torch import dynamo_config
    dynamo_config.graph_cache(False)
    model, inputs = _model(case)
    with torch.no_grad():
        compiled = torch.compile(model, backend="kiln")
        compiled(*inputs)
        kiln.save(compiled, path)
    print(f"saved {case} to {path}")


def compare(case: str, files: dict[str, str], rounds: int, repeats: int) -> dict:
    """Interleaved timings of the saved models `files` (label -> path) of `case`."""
    import kiln
    model, inputs = _model(case)
    loads = os.getloadavg()
    with torch.no_grad():
        want = model(*inputs)
        fns = {label: kiln.load(path) for label, path in files.items()}
        for label, fn in fns.items():
            print(f"{label}: relative error against eager {relative_error(fn(*inputs), want):.1e}")
            fn(*inputs)
        wall, cpu = {k: [] for k in fns}, {k: [] for k in fns}
        for _ in range(rounds):
            for label, fn in fns.items():
                for _ in range(repeats):
                    start, start_cpu = time.perf_counter(), time.process_time()
                    fn(*inputs)
                    wall[label].append((time.perf_counter() - start) * 1e3)
                    cpu[label].append((time.process_time() - start_cpu) * 1e3)
    first = statistics.median(next(iter(wall.values())))
    out = {"case": case, "threads": torch.get_num_threads(), "load_before": loads, "load_after": os.getloadavg()}
    for label in fns:
        med = statistics.median(wall[label])
        out[label] = {"wall_min_ms": min(wall[label]), "wall_median_ms": med, "cpu_median_ms": statistics.median(cpu[label])}
        print(f"{label:>12s}: wall min {min(wall[label]):8.2f} median {med:8.2f} ms, CPU median "
              f"{statistics.median(cpu[label]):8.2f} ms, median against the first {med / first:.3f}x")
    print(f"{case}, {out['threads']} thread(s); load average before {loads[0]:.2f}, after {out['load_after'][0]:.2f}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("action", choices=["save", "compare"])
    parser.add_argument("paths", nargs="+", help="save: the file; compare: LABEL=FILE ...")
    parser.add_argument("--case", default="resnet50_b8", choices=list(CASES))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.action == "save":
        save(args.case, args.paths[0])
    else:
        compare(args.case, dict(p.split("=", 1) for p in args.paths), args.rounds, args.repeats)


if __name__ == "__main__":
    main()
