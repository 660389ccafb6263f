"""Kiln's speed-ups in one picture, drawn from the newest records in benchmarks/results/.

    python benchmarks/plot.py [--results benchmarks/results] [--out benchmarks/speedup.png]
        [--gpu H200] [--days 2] [--exclude REGEX]

Reads the JSON records that `--json` of models_bench.py, decode_bench.py, train_bench.py,
gemm_bench.py and attention_bench.py writes (each recognized by its rows' fields) and draws
Kiln's speed-up, the other side's time over Kiln's, per case:

- inference (models_bench): over eager PyTorch and over Inductor with CUDA graphs;
- decoding (decode_bench, time per token): over eager and over Inductor with CUDA graphs;
- training steps (train_bench): over eager and over Inductor (its default mode);
- GEMM kernels against cuBLAS (gemm_bench), the geometric mean of each group of shapes;
- attention kernels against PyTorch's flash attention (attention_bench), per shape, the
  geometric mean over dtypes.

Which numbers: the records of one GPU (`--gpu`; by default that of the newest record), whose
GPU is their "gpu" field, else their file name's first word (`h200_models_...json`). A record's
age is the time of the commit that added it (git), else, for a file git does not know, its
modification time. Each case is taken from the newest record holding it, and left out where
that record is more than `--days` days older than its workload's newest (older code). Records
of A/B runs, sweeps, variants and "before" states are left out by name (`--exclude`).

Needs matplotlib (`pip install matplotlib`), which Kiln itself does not depend on.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from statistics import geometric_mean

HERE = Path(__file__).parent
EXCLUDE = r"(^|_)(ab\d*|before|sweep|fastmath|noise|slowhost|dependent_launch)(_|\.|$)"
DAY = 24 * 3600
TICKS = [0.25, 0.5, 0.75, 1, 1.25, 1.5, 2, 3, 5, 10, 20, 50]
COLORS = {"eager": "#9aa5b1", "cuBLAS": "#4c72b0", "PyTorch flash attention": "#4c72b0", "other": "#dd8452"}


@dataclass(frozen=True)
class Record:
    """One JSON file of results: its path, age (seconds since the epoch), GPU and content."""

    path: Path
    time: float
    gpu: str
    data: object


@dataclass(frozen=True)
class Workload:
    """A panel: `cases(data)` reads a record's cases ({key: {baseline: speed-up}}), None where
    the record is of another kind; `label(key)` names a case, or the group it is averaged in."""

    title: str
    cases: Callable[[object], dict | None]
    label: Callable[[tuple], str]
    grouped: bool = False


def _rows(data, fields: set[str]) -> list[dict] | None:
    """The rows of a record (a list, or a dict's "rows") if they are dicts and the first has
    `fields`; the rows that have them all."""
    rows = data if isinstance(data, list) else data.get("rows") if isinstance(data, dict) else None
    if not rows or not isinstance(rows[0], dict) or not fields <= rows[0].keys():
        return None
    return [r for r in rows if fields <= r.keys()]


def _inference(data) -> dict | None:
    rows = _rows(data, {"model", "dtype", "eager_ms", "inductor_cg_ms", "kiln_ms"})
    return None if rows is None else {
        (r["model"], r["dtype"]): {"eager": r["eager_ms"] / r["kiln_ms"],
                                   "Inductor + CUDA graphs": r["inductor_cg_ms"] / r["kiln_ms"]}
        for r in rows}


def _decode(data) -> dict | None:
    rows = _rows(data, {"model", "batch", "backend"})
    if rows is None:
        return None
    ms = defaultdict(dict)
    for r in rows:
        if "ms_per_token" in r:
            ms[(r["model"], f"b{r['batch']}")][r["backend"]] = r["ms_per_token"]
    return {case: {"eager": t["eager"] / t["kiln"], "Inductor + CUDA graphs": t["inductor_cg"] / t["kiln"]}
            for case, t in ms.items() if {"eager", "inductor_cg", "kiln"} <= t.keys()}


def _training(data) -> dict | None:
    rows = _rows(data, {"case", "kiln_ms"})
    if rows is None or not any("eager_first_loss" in r or "eager_losses" in r for r in rows):
        return None
    return {
        (r["case"],): {"eager": r["eager_ms"] / r["kiln_ms"], "Inductor": r["inductor_ms"] / r["kiln_ms"]}
        for r in rows if {"eager_ms", "inductor_ms", "kiln_ms"} <= r.keys()}


def _gemm(data) -> dict | None:
    rows = _rows(data, {"group", "name", "dtype", "template", "kiln_us", "torch_us"})
    return None if rows is None else {
        (r["group"], r["name"], r["dtype"]): {"cuBLAS": r["torch_us"] / r["kiln_us"]} for r in rows}


def _attention(data) -> dict | None:
    rows = _rows(data, {"name", "shape", "causal", "dtype", "kiln_us", "torch_us"})
    return None if rows is None else {
        (r["name"], r["dtype"]): {"PyTorch flash attention": r["torch_us"] / r["kiln_us"]} for r in rows}


WORKLOADS = [
    Workload("Inference (models_bench)", _inference, lambda k: f"{k[0]} {k[1]}"),
    Workload("Decoding a token (decode_bench)", _decode, lambda k: f"{k[0]} {k[1]}"),
    Workload("Training step (train_bench)", _training, lambda k: k[0]),
    Workload("GEMM against cuBLAS (gemm_bench), geometric mean per group", _gemm,
             lambda k: f"GEMM {k[0]}", grouped=True),
    Workload("Attention against PyTorch's flash (attention_bench)", _attention,
             lambda k: k[0], grouped=True),
]


def gpu_name(text: str) -> str:
    """'H200' of 'NVIDIA H200', of 'NVIDIA H100 80GB HBM3' 'H100', of 'h200' 'H200'."""
    words = [w for w in text.replace("_", " ").split() if w.upper() != "NVIDIA"]
    return words[0].upper() if words else text


def added_times(folder: Path) -> dict[str, float]:
    """The commit time of the commit that added each file of `folder` that git knows, by name."""
    log = subprocess.run(["git", "log", "--diff-filter=A", "--format=@%ct", "--name-only", "--", "."],
                         cwd=folder, capture_output=True, text=True)
    times, when = {}, 0.0
    for line in log.stdout.splitlines():
        if line.startswith("@"):
            when = float(line[1:])
        elif line:
            times.setdefault(Path(line).name, when)
    return times


def records(folder: Path, exclude: str) -> list[Record]:
    """The JSON records of `folder` whose names `exclude` does not match, oldest first."""
    times = added_times(folder)
    found = []
    for path in sorted(folder.glob("*.json")):
        if re.search(exclude, path.stem):
            continue
        data = json.loads(path.read_text())
        gpu = data.get("gpu") if isinstance(data, dict) else None
        found.append(Record(path, times.get(path.name, path.stat().st_mtime),
                            gpu_name(gpu or path.stem.split("_")[0]), data))
    return sorted(found, key=lambda r: (r.time, r.path.name))


def newest_cases(workload: Workload, found: list[Record], days: float) -> tuple[dict, set[str]]:
    """{label: {baseline: speed-up}} of `workload` from `found` (oldest first), each case from
    the newest record holding it, geometric means for a grouped workload; and the files used."""
    taken = {}
    for record in found:
        for key, speedups in (workload.cases(record.data) or {}).items():
            taken[key] = (record, speedups)
    if not taken:
        return {}, set()
    newest = max(record.time for record, _ in taken.values())
    taken = {k: v for k, v in taken.items() if v[0].time >= newest - days * DAY}
    by_label = defaultdict(list)
    for key, (_, speedups) in taken.items():
        by_label[workload.label(key)].append(speedups)
    cases = {}
    for label, runs in by_label.items():
        name = f"{label} ({len(runs)})" if workload.grouped else label
        cases[name] = {b: geometric_mean(r[b] for r in runs) for b in runs[0]}
    return cases, {record.path.name for record, _ in taken.values()}


def draw(panels: list[tuple[Workload, dict, set[str]]], gpu: str, out: Path) -> None:
    """Each panel's speed-ups as horizontal bars from 1x on a log axis, written to `out`."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, NullLocator

    heights = [len(cases) * len(next(iter(cases.values()))) + 2 for _, cases, _ in panels]
    figure, axes = plt.subplots(len(panels), 1, figsize=(12, 0.25 * sum(heights) + 1.5),
                                gridspec_kw={"height_ratios": heights}, squeeze=False,
                                layout="constrained")
    for ax, (workload, cases, files) in zip(axes[:, 0], panels):
        labels = list(cases)
        baselines = list(cases[labels[0]])
        width = 0.8 / len(baselines)
        values = [v for speedups in cases.values() for v in speedups.values()]
        for b, baseline in enumerate(baselines):
            ys = [k + (b - (len(baselines) - 1) / 2) * width for k in range(len(labels))]
            xs = [cases[label][baseline] for label in labels]
            ax.barh(ys, [x - 1 for x in xs], left=1, height=width, label=f"over {baseline}",
                    color=COLORS.get(baseline, COLORS["other"]))
            for y, x in zip(ys, xs):
                ax.text(x, y, f" {x:.2f}x ", va="center", ha="left" if x >= 1 else "right", fontsize=7)
        ax.set_xscale("log")
        low, high = min(values + [1.0]) / 1.25, max(values + [1.0]) * 1.25
        ax.set_xlim(low, high)
        ax.xaxis.set_major_locator(FixedLocator([t for t in TICKS if low <= t <= high]))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_major_formatter(lambda x, _: f"{x:g}x")
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.set_yticks(range(len(labels)), labels, fontsize=8)
        ax.set_ylim(len(labels) - 0.5, -0.5)
        ax.set_title(workload.title, fontsize=10, loc="left")
        ax.set_title(", ".join(sorted(files)), fontsize=6, loc="right", color="#555555")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
        ax.tick_params(axis="x", labelsize=7)
    figure.suptitle(f"Kiln's speed-up on one NVIDIA {gpu}: the other side's time over Kiln's "
                    "(right of 1x, Kiln is faster)", fontsize=11)
    figure.savefig(out, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=HERE / "results")
    parser.add_argument("--out", type=Path, default=HERE / "speedup.png")
    parser.add_argument("--gpu", help="the GPU whose records to draw (H100, H200; default: the newest record's)")
    parser.add_argument("--days", type=float, default=2.0,
                        help="leave out cases measured this many days before their workload's newest")
    parser.add_argument("--exclude", default=EXCLUDE, help="leave out records whose file name matches")
    args = parser.parse_args()
    found = [r for r in records(args.results, args.exclude) if any(w.cases(r.data) for w in WORKLOADS)]
    if not found:
        raise SystemExit(f"no benchmark record in {args.results}")
    gpu = gpu_name(args.gpu) if args.gpu else found[-1].gpu
    found = [r for r in found if r.gpu == gpu]
    panels = [(w, *newest_cases(w, found, args.days)) for w in WORKLOADS]
    panels = [p for p in panels if p[1]]
    draw(panels, gpu, args.out)
    for workload, cases, files in panels:
        print(f"{workload.title}: {len(cases)} cases from {', '.join(sorted(files))}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
