"""What is allocated at the peak of a training run: the CUDA caching allocator's history replayed.

For each case of `train_bench` and each backend, the model trains `--steps` steps with
`torch.cuda.memory._record_memory_history` on; the recorded allocations and frees are replayed
to find the moment most bytes were allocated (what `torch.cuda.max_memory_allocated` reports,
less what was allocated before the first step), and the blocks live at that moment are summed by
where they were allocated: the innermost Python frame in `--package` (Kiln's own code by default)
or else in torch, with the number of blocks and the largest.

    python benchmarks/memory_peak.py [--cases vit_b16_b32 ...] [--backends inductor kiln]
        [--steps 3] [--top 15] [--depth 2] [--json out.json]
"""
from __future__ import annotations

import argparse
import collections
import gc
import json
import warnings

import torch

from train_bench import BACKENDS, CASES

MB = 1e6


def where(frames: list[dict], packages: tuple[str, ...], depth: int = 2) -> str:
    """The `depth` innermost frames of `frames` in the first of `packages` that has any, as
    file:line (function) < its caller."""
    for package in packages:
        inside = [f for f in frames if package in f["filename"]][:depth]
        if inside:
            return " < ".join(f"{f['filename'].split(package)[-1]}:{f['line']} ({f['name']})" for f in inside)
    return "(no Python frame)"


STEP_MARK = 7919 * 512     # the bytes of a tensor allocated at each step's start, to find steps in the trace


def live_at_peak(trace: list[dict], packages: tuple[str, ...], from_step: int = 0,
                 to_step: int | None = None, depth: int = 2) -> tuple[int, list[dict]]:
    """The most bytes allocated at once over `trace` (one device's events) from the start of step
    `from_step` to the end of step `to_step` (steps counted by `STEP_MARK` allocations) and the
    blocks live then."""
    live, allocated, peak, at_peak, step = {}, 0, 0, {}, -1
    for event in trace:
        action = event["action"]
        if action == "alloc" and event["size"] == STEP_MARK:
            step += 1
        elif action == "alloc":
            live[event["addr"]] = event
            allocated += event["size"]
            if allocated > peak and from_step <= step <= (step if to_step is None else to_step):
                peak, at_peak = allocated, dict(live)
        elif action == "free_completed" and event["addr"] in live:
            allocated -= live.pop(event["addr"])["size"]
    return peak, [{"size": e["size"], "where": where(e.get("frames", []), packages, depth)} for e in at_peak.values()]


def summary(blocks: list[dict], top: int) -> list[dict]:
    groups = collections.defaultdict(lambda: {"bytes": 0, "blocks": 0, "largest": 0})
    for b in blocks:
        g = groups[b["where"]]
        g["bytes"] += b["size"]
        g["blocks"] += 1
        g["largest"] = max(g["largest"], b["size"])
    ranked = sorted(groups.items(), key=lambda kv: -kv[1]["bytes"])[:top]
    return [{"where": w, **g} for w, g in ranked]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=["vit_b16_b32"], choices=list(CASES))
    parser.add_argument("--backends", nargs="+", default=["inductor", "kiln"], choices=list(BACKENDS))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--package", nargs="+", default=["/kiln/", "torch/"],
                        help="path fragments naming the code a block is charged to, in order of preference")
    parser.add_argument("--depth", type=int, default=2, help="frames in a block's place (more tell callers apart)")
    parser.add_argument("--json", help="write the rows to this file")
    args = parser.parse_args()
    warnings.simplefilter("ignore", FutureWarning)
    torch.backends.cuda.matmul.allow_tf32 = False
    rows = []
    for name in args.cases:
        for label in args.backends:
            torch.manual_seed(0)
            model, loss_of, make_optimizer = CASES[name]()
            optimizer = make_optimizer(model.parameters())
            torch._dynamo.reset()
            compiled = model if BACKENDS[label] is None else torch.compile(model, **BACKENDS[label])
            torch.cuda.reset_peak_memory_stats()
            start = torch.cuda.memory_allocated()
            torch.cuda.memory._record_memory_history(stacks="python", max_entries=4_000_000)
            for _ in range(args.steps):
                torch.empty(STEP_MARK, dtype=torch.uint8, device="cuda")    # freed at once
                torch.compiler.cudagraph_mark_step_begin()
                loss_of(compiled).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            snapshot = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            trace = snapshot["device_traces"][torch.cuda.current_device()]
            reported = torch.cuda.max_memory_allocated() - start
            row = {"case": name, "backend": label, "peak_above_start": reported}
            row["step_peaks"] = [live_at_peak(trace, (), k, k)[0] for k in range(args.steps)]
            print(f"{name} {label}: each step's peak, MB: {' '.join(f'{b / MB:.0f}' for b in row['step_peaks'])}")
            for when, from_step in (("every step", 0), ("the last step", args.steps - 1)):
                peak, blocks = live_at_peak(trace, tuple(args.package), from_step, depth=args.depth)
                row[when] = {"peak": peak, "groups": summary(blocks, args.top)}
                print(f"{name} {label}: peak above the start {reported / MB:.0f} MB; over {when} "
                      f"{peak / MB:.0f} MB in {len(blocks)} blocks")
                for g in row[when]["groups"]:
                    print(f"  {g['bytes'] / MB:9.1f} MB {g['blocks']:6d} blocks, largest {g['largest'] / MB:8.1f} MB  {g['where']}")
            rows.append(row)
            del model, optimizer, compiled, snapshot
            torch._dynamo.reset()
            gc.collect()
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
