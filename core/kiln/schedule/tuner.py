"""The tuner: picks a template's knobs for a task on a GPU by timing candidates.

Level 0 takes the template's first suggestion for the task's shape on this GPU (its cost model:
tile size and split-K from M, N, K and the SM count; `Template.suggest`), or its default where
it suggests nothing. At levels 1 and 2 the template's space and its first SUGGESTED[level]
suggestions are compiled in parallel (NVRTC threads), loaded, and timed with CUDA events on
fresh random inputs; the winner is cached on disk per task, template sources and GPU model, so
a second process does not tune again. A task with symbolic sizes is keyed by its candidates'
sources alone, which a symbolic template renders alike for every size of a bucket (its
`suggest` buckets sizes): the winner timed at one size serves its bucket.

Tuning tells its progress on stderr (`kiln.progress`): a bar on a terminal, and one line per
template tuned (the winner, the candidates, the seconds); `KILN_PROGRESS=0` silences it.
"""
from __future__ import annotations

import json
import os
import statistics
import tempfile
import threading

import torch

from kiln.device import Device
from kiln.ir.compute import Task
from kiln.ir.specialize import has_symbolic_sizes
from kiln.log import current_record, logger
from kiln.progress import Progress
from kiln.runtime import cuda as rt
from kiln.runtime.backend import backend_for
from kiln.runtime.cache import cache_dir, content_key

SUGGESTED = {0: 1, 1: 3, 2: 6}       # suggestions taken at each level

_timing = threading.Lock()   # one task timed at a time, even when kernels are built in parallel


def _random_inputs(task: Task, device: Device) -> list[torch.Tensor]:
    out = []
    for t in task.inputs:
        dt = t.dtype.torch_dtype
        if dt.is_floating_point:
            out.append(torch.randn(t.shape, device=device.torch()).to(dt))
        elif dt == torch.bool:
            out.append(torch.randint(0, 2, t.shape, device=device.torch()).bool())
        else:
            out.append(torch.randint(0, 8, t.shape, device=device.torch()).to(dt))
    return out


def time_runner(runner, task: Task, device: Device, repeats: int = 20, warmup: int = 3) -> float:
    """Median milliseconds of one run of `runner` on fresh random inputs."""
    inputs = _random_inputs(task, device)
    outputs = [torch.empty(o.shape, dtype=o.dtype.torch_dtype, device=device.torch()) for o in task.outputs]
    for _ in range(warmup):
        runner(inputs, outputs)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        runner(inputs, outputs)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _record_path(key: str):
    folder = cache_dir() / "tuning"
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    return folder / f"{key}.json"


def candidates(template, task: Task, sm_count: int, level: int, arch: int | None = None) -> list[dict]:
    """The knob settings to try at `level`: the template's first suggestions for `task` on a GPU
    of `sm_count` multiprocessors, then its space (level 0: only the first of these); on a GPU of
    architecture `arch` (90 for sm_90; any when None), only the settings it runs
    (`Template.knob_arch`)."""
    runs = lambda knobs: arch is None or template.knob_arch(knobs) <= arch
    suggested = [k for k in template.suggest(task, sm_count) if runs(k)] if template.suggest else []
    suggested = suggested[:SUGGESTED[level]]
    out, seen = [], set()
    for knobs in suggested + ([] if level == 0 and suggested else template.space(level)):
        key = tuple(sorted(knobs.items()))
        if runs(knobs) and key not in seen:
            seen.add(key)
            out.append(dict(knobs))
    return out[:1] if level == 0 else out


def tune(task: Task, template, device: Device, level: int, arch: int | None = None) -> dict:
    """The best knobs of `template` (a `kiln.schedule.Template`) for `task` on `device` at
    tuning `level` (cached on disk), of the settings that a GPU of architecture `arch` runs (any
    when None: `candidates`). Only CUDA templates are timed: a CPU template runs with its level-0
    knobs for the machine's core count."""
    if device.kind != "cuda":
        return candidates(template, task, os.cpu_count() or 1, 0)[0]
    info = rt.device_info(device.index)
    space = candidates(template, task, info["sm_count"], level, arch)
    if len(space) == 1:
        return space[0]
    programs = [template.render(task, **knobs) for knobs in space]
    shapes = "symbolic" if has_symbolic_sizes(task) else repr(task)
    key = content_key("tune", template.name, shapes, repr(sorted(task.attrs.items())), info["name"],
                      rt.nvrtc_version(), *(p.source for p in programs))
    record = _record_path(key)
    try:
        knobs = json.loads(record.read_text())["knobs"]
        current_record().add_tuning_reused()
        return knobs
    except (OSError, ValueError, KeyError):
        pass
    results = []
    with Progress(len(space), f"tuning {template.name}", unit="candidate") as progress:
        rt.compile_many([(p.source, p.kernel_names[0], p.arch_for(info["arch"])) for p in programs])
        with _timing:
            for n, (knobs, program) in enumerate(zip(space, programs), 1):
                try:
                    ms = time_runner(backend_for(device).load(program, device), task, device)
                    results.append((ms, n, knobs))
                except rt.CudaError as exc:  # a candidate the GPU cannot launch (too much shared memory)
                    logger.info("tuning %s: candidate %s failed: %s", template.name, knobs, exc)
                progress.step()
        if not results:
            raise rt.CudaError(f"no candidate of template '{template.name}' ran for {task!r}")
        best_ms, _, best = min(results)
        failed = len(space) - len(results)
        seconds = progress.done(f"tuned {template.name} for {task!r}: {best} at {best_ms:.4f} ms"
                                + (f", {failed} failed" if failed else ""))
    current_record().add_tuned({"template": template.name, "task": repr(task), "best": best,
                                "best_ms": best_ms, "candidates": len(space), "failed": failed,
                                "seconds": seconds})
    logger.info("tuned %s for %r: %s at %.4f ms (of %d timed)", template.name, task, best, best_ms,
                len(results))
    fd, tmp = tempfile.mkstemp(dir=record.parent, prefix=".tmp-")
    with os.fdopen(fd, "w") as f:
        json.dump({"knobs": best, "template": template.name, "gpu": info["name"],
                   "times_ms": [[r[2], r[0]] for r in results]}, f)
    os.replace(tmp, record)
    return best
