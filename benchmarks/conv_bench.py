"""Benchmark of Kiln's channels-last convolutions against torch (cuDNN, channels_last) on one GPU.

Every conv2d shape of ResNet-50 (torchvision, stride on the 3x3) at batch 1 and 32 in float16,
as `conv2d_channels_last` on NHWC data with OHWI weights (the stem's 3 channels padded to 8, as
the layout pass does; torch runs it with 3). Each side runs as a CUDA graph of REPS calls (launch
gaps out of the numbers), timed with CUDA events after a warm-up, median of several replays;
Kiln's kernel is its level-0 choice (`--level` 1 or 2 tunes). The summary weighs each shape by
how often ResNet-50 runs it. `--sweep` also times every knob setting of conv_sm90's level-1 space
per shape. `--json PATH` writes every row.
Usage: python3 benchmarks/conv_bench.py [--batch 1,32] [--sweep] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import math
import statistics

import torch
import torch.nn.functional as F

import kiln
from kiln.plugins.registry import registry

REPS = 20

# (input size, in channels, out channels, kernel, stride, padding, times in ResNet-50)
RESNET50 = [(224, 3, 64, 7, 2, 3, 1),
            (56, 64, 64, 1, 1, 0, 1), (56, 64, 64, 3, 1, 1, 3), (56, 64, 256, 1, 1, 0, 4), (56, 256, 64, 1, 1, 0, 2),
            (56, 256, 128, 1, 1, 0, 1), (56, 128, 128, 3, 2, 1, 1), (28, 128, 512, 1, 1, 0, 4),
            (56, 256, 512, 1, 2, 0, 1), (28, 512, 128, 1, 1, 0, 3), (28, 128, 128, 3, 1, 1, 3),
            (28, 512, 256, 1, 1, 0, 1), (28, 256, 256, 3, 2, 1, 1), (14, 256, 1024, 1, 1, 0, 6),
            (28, 512, 1024, 1, 2, 0, 1), (14, 1024, 256, 1, 1, 0, 5), (14, 256, 256, 3, 1, 1, 5),
            (14, 1024, 512, 1, 1, 0, 1), (14, 512, 512, 3, 2, 1, 1), (7, 512, 2048, 1, 1, 0, 3),
            (14, 1024, 2048, 1, 2, 0, 1), (7, 2048, 512, 1, 1, 0, 2), (7, 512, 512, 3, 1, 1, 2)]


def _graph_time(fn) -> float:
    """Median seconds of one `fn()` call, from replays of a CUDA graph of REPS calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPS):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(7):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / REPS)
    return statistics.median(times)


def _case(batch, size, cin, cout, k, stride, pad):
    """(task, kiln operands, torch operands, conv kwargs, output shape, flops)."""
    padded = max(cin, 8)
    x = torch.randn(batch, size, size, padded, device="cuda", dtype=torch.float16)
    w = torch.randn(cout, k, k, padded, device="cuda", dtype=torch.float16) * (1 / math.sqrt(k * k * cin))
    x[..., cin:] = 0
    w[..., cin:] = 0
    kwargs = {"stride": stride, "padding": pad}
    definition = registry().operator("conv2d_channels_last")
    task = definition.task(definition.bind([kiln.from_torch(x), kiln.from_torch(w)], kwargs))[0]
    tx, tw = x[..., :cin].permute(0, 3, 1, 2).contiguous(memory_format=torch.channels_last), \
        w[..., :cin].permute(0, 3, 1, 2).contiguous(memory_format=torch.channels_last)
    out = task.outputs[0].shape
    return task, (x, w), (tx, tw), kwargs, out, 2 * out[0] * out[1] * out[2] * cout * k * k * cin


def _kiln_runner(program):
    from kiln.runtime.backend import backend_for
    return backend_for(kiln.device("cuda")).load(program, kiln.device("cuda"))


def _time_program(program, operands, out, reference) -> tuple[float, float]:
    """(seconds, relative error against `reference`) of a program."""
    runner = _kiln_runner(program)
    out.fill_(float("nan"))
    runner(list(operands), [out])
    err = ((out.double() - reference).norm() / reference.norm()).item()
    return _graph_time(lambda: runner(list(operands), [out])), err


def main():
    from kiln.runtime import cuda as rt
    from kiln.schedule import schedules_for
    from kiln.schedule.tuner import candidates, tune
    from kiln_ops_builtin.templates import conv_sm90
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", default="1,32", help="comma-separated batch sizes")
    parser.add_argument("--level", type=int, default=0, help="Kiln's tuning level")
    parser.add_argument("--sweep", action="store_true", help="also time every level-1 knob setting of conv_sm90")
    parser.add_argument("--json", help="write the rows here")
    opts = parser.parse_args()
    gpu, sms = torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0).multi_processor_count
    arch = rt.arch_number(rt.device_info(0)["arch"])
    print(f"GPU: {gpu} ({sms} SMs), torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}", flush=True)
    cases = [(b, shape) for b in map(int, opts.batch.split(",")) for shape in RESNET50]
    built = [_case(b, *shape[:6]) for b, shape in cases]
    chosen = []
    for task, *_ in built:
        template = schedules_for(task, "cuda", arch)[0]
        knobs = tune(task, template, kiln.device("cuda"), opts.level) if opts.level else \
            candidates(template, task, sms, 0)[0]
        chosen.append((template, knobs, template.render(task, **knobs)))
    sweeps = []
    if opts.sweep:
        for task, *_ in built:
            widest = max(64, 1 << (task.outputs[0].shape[-1] - 1).bit_length())     # no wider BN than N needs
            settings = [dict(k) for k in dict.fromkeys(tuple(sorted(k.items())) for k in
                                                       conv_sm90.space(1) + conv_sm90.suggest(task, sms)[:2])
                        if dict(k)["BN"] <= widest]
            sweeps.append([(k, conv_sm90.render(task, **k)) for k in settings])
    build = lambda programs: rt.compile_many([(p.source, p.kernel_names[0], p.arch_for(rt.device_info(0)["arch"]))
                                              for p in programs])
    build([p for _, _, p in chosen])
    rows = []
    for n, ((batch, shape), (task, operands, torch_ops, kwargs, out_shape, flops), (template, knobs, program)) in \
            enumerate(zip(cases, built, chosen)):
        size, cin, cout, k, stride, pad, count = shape
        reference = F.conv2d(*[t.double() for t in torch_ops], **kwargs).permute(0, 2, 3, 1)
        out = torch.empty(out_shape, dtype=torch.float16, device="cuda")
        t_kiln, err = _time_program(program, operands, out, reference)
        t_torch = _graph_time(lambda: F.conv2d(*torch_ops, **kwargs))
        row = {"batch": batch, "name": f"{size}x{size} {cin}->{cout} k{k} s{stride}", "count": count,
               "template": template.name, "knobs": knobs, "kiln_us": t_kiln * 1e6, "torch_us": t_torch * 1e6,
               "kiln_tflops": flops / t_kiln / 1e12, "ratio": t_torch / t_kiln, "rel_err": err}
        if sweeps:
            build([p for _, p in sweeps[n]])
            found = []
            for setting, candidate in sweeps[n]:
                t, e = _time_program(candidate, operands, out, reference)
                if e < 1e-2:
                    found.append({"knobs": setting, "us": t * 1e6})
                else:
                    print(f"    WRONG {setting}: relative error {e}", flush=True)
            row["sweep"] = sorted(found, key=lambda f: f["us"])
            if found:
                best = row["sweep"][0]
                print(f"    best {best['knobs']} {best['us']:.1f} us; level 0 at {best['us'] / row['kiln_us']:.2f} of it",
                      flush=True)
        rows.append(row)
        print(f"b{batch:<3d} {row['name']:26s} x{count} {template.name:9s} kiln {row['kiln_us']:8.1f} us "
              f"{row['kiln_tflops']:6.1f} TF  torch {row['torch_us']:8.1f} us  ratio {row['ratio']:.3f}  err {err:.1e}",
              flush=True)
    for batch in dict.fromkeys(r["batch"] for r in rows):
        mine = [r for r in rows if r["batch"] == batch]
        ratios = [r["ratio"] for r in mine]
        total_kiln, total_torch = (sum(r[key] * r["count"] for r in mine) for key in ("kiln_us", "torch_us"))
        print(f"batch {batch}: geomean {math.exp(sum(map(math.log, ratios)) / len(ratios)):.3f}, min {min(ratios):.3f}; "
              f"all 53 convs kiln {total_kiln:.0f} us, torch {total_torch:.0f} us")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"gpu": gpu, "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(), "rows": rows},
                      f, indent=1)


if __name__ == "__main__":
    main()
