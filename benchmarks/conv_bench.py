"""Benchmark of Kiln's channels-last convolutions against torch (cuDNN, channels_last) on one GPU.

`--suite resnet50` (the default): every conv2d shape of ResNet-50 (torchvision, stride on the
3x3) at batch 1 and 32 in float16, as `conv2d_channels_last` on NHWC data with OHWI weights (the
stem's 3 channels padded to 8, as the layout pass does; torch runs it with 3). `--suite
depthwise`: every depthwise shape of MobileNetV3-large, EfficientNet-B0 and ConvNeXt-tiny
(torchvision, 224x224) at batch 1 and 8 in float16, NHWC data with (C, kH, kW, 1) weights, no
bias (Kiln's conv_depthwise_nhwc; torch's depthwise cuDNN kernels on channels_last tensors);
their rows report memory throughput (input, weights and output bytes over the time).
The first layer (fewer than 8 input channels) is timed as the model runs it, from the NCHW
input on both sides: Kiln's optimized graph of the convolution (the kernel converting to
channels-last, which `space_to_depth` makes stack each stride cell's pixels as channels, then
the convolution it made) against torch's conversion to channels_last and cuDNN's convolution.
Each side runs as a CUDA graph of 20 calls (`gemm_bench._graph_time`: launch gaps out of the
numbers), timed with CUDA events after a warm-up, median of several replays; Kiln's kernel is
its level-0 choice (`--level` 1 or 2 tunes). The summary weighs each shape by how often its model runs it.
`--sweep` also times every knob setting of the chosen template's level-1 space per shape
(`--sweep-level 2`: level 2's). `--json PATH` writes every row.
Usage: python3 benchmarks/conv_bench.py [--suite resnet50|depthwise] [--batch 1,32] [--sweep] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import math

import torch
import torch.nn.functional as F

import kiln
from gemm_bench import _graph_time
from kiln.plugins.registry import registry


# (input size, in channels, out channels, kernel, stride, padding, times in ResNet-50)
RESNET50 = [(224, 3, 64, 7, 2, 3, 1),
            (56, 64, 64, 1, 1, 0, 1), (56, 64, 64, 3, 1, 1, 3), (56, 64, 256, 1, 1, 0, 4), (56, 256, 64, 1, 1, 0, 2),
            (56, 256, 128, 1, 1, 0, 1), (56, 128, 128, 3, 2, 1, 1), (28, 128, 512, 1, 1, 0, 4),
            (56, 256, 512, 1, 2, 0, 1), (28, 512, 128, 1, 1, 0, 3), (28, 128, 128, 3, 1, 1, 3),
            (28, 512, 256, 1, 1, 0, 1), (28, 256, 256, 3, 2, 1, 1), (14, 256, 1024, 1, 1, 0, 6),
            (28, 512, 1024, 1, 2, 0, 1), (14, 1024, 256, 1, 1, 0, 5), (14, 256, 256, 3, 1, 1, 5),
            (14, 1024, 512, 1, 1, 0, 1), (14, 512, 512, 3, 2, 1, 1), (7, 512, 2048, 1, 1, 0, 3),
            (14, 1024, 2048, 1, 2, 0, 1), (7, 2048, 512, 1, 1, 0, 2), (7, 512, 512, 3, 1, 1, 2)]

# model -> (input size, channels, kernel, stride, times in the model) of its depthwise convolutions
DEPTHWISE = {
    "mobilenet_v3_large": [(112, 16, 3, 1, 1), (112, 64, 3, 2, 1), (56, 72, 3, 1, 1), (56, 72, 5, 2, 1),
                           (28, 120, 5, 1, 2), (28, 240, 3, 2, 1), (14, 200, 3, 1, 1), (14, 184, 3, 1, 2),
                           (14, 480, 3, 1, 1), (14, 672, 3, 1, 1), (14, 672, 5, 2, 1), (7, 960, 5, 1, 2)],
    "efficientnet_b0": [(112, 32, 3, 1, 1), (112, 96, 3, 2, 1), (56, 144, 3, 1, 1), (56, 144, 5, 2, 1),
                        (28, 240, 5, 1, 1), (28, 240, 3, 2, 1), (14, 480, 3, 1, 2), (14, 480, 5, 1, 1),
                        (14, 672, 5, 1, 2), (14, 672, 5, 2, 1), (7, 1152, 5, 1, 3), (7, 1152, 3, 1, 1)],
    "convnext_tiny": [(56, 96, 7, 1, 3), (28, 192, 7, 1, 3), (14, 384, 7, 1, 9), (7, 768, 7, 1, 3)],
}
SUITES = {
    "resnet50": (lambda: [("resnet50", (size, cin, cout, k, stride, pad, 1), count)
                          for size, cin, cout, k, stride, pad, count in RESNET50], "1,32"),
    "depthwise": (lambda: [(model, (size, c, c, k, stride, k // 2, c), count)
                           for model, rows in DEPTHWISE.items() for size, c, k, stride, count in rows], "1,8"),
}


def _case(batch, size, cin, cout, k, stride, pad, groups=1):
    """(task, kiln operands, torch operands, conv kwargs, output shape, work): work is the flops of
    an ungrouped convolution, the bytes a grouped one moves at least."""
    padded = max(cin, 8) if groups == 1 else cin
    x = torch.randn(batch, size, size, padded, device="cuda", dtype=torch.float16)
    w = torch.randn(cout, k, k, padded // groups, device="cuda", dtype=torch.float16) * (1 / math.sqrt(k * k * cin // groups))
    x[..., cin:] = 0
    w[..., cin // groups:] = 0
    kwargs = {"stride": stride, "padding": pad, "groups": groups}
    definition = registry().operator("conv2d_channels_last")
    task = definition.task(definition.bind([kiln.from_torch(x), kiln.from_torch(w)], kwargs))[0]
    tx, tw = x[..., :cin].permute(0, 3, 1, 2).contiguous(memory_format=torch.channels_last), \
        w[..., :cin // groups].permute(0, 3, 1, 2).contiguous(memory_format=torch.channels_last)
    out = task.outputs[0].shape
    if groups > 1:
        return task, (x, w), (tx, tw), kwargs, out, 2 * (x.numel() + w.numel() + math.prod(out))
    return task, (x, w), (tx, tw), kwargs, out, 2 * out[0] * out[1] * out[2] * cout * k * k * cin


def _first_layer(batch, size, cin, cout, k, stride, pad):
    """(Kiln's step, torch's step, Kiln's result, reference, the graph's steps) of the
    first layer from NCHW data (see the module doc); the result is channels-last."""
    from kiln.passes import optimize
    x = torch.randn(batch, cin, size, size, device="cuda", dtype=torch.float16)
    w = torch.randn(cout, cin, k, k, device="cuda", dtype=torch.float16) * (1 / math.sqrt(k * k * cin))
    symbol = kiln.symbol(tuple(x.shape), "float16", "cuda")
    y = kiln.ops.permute(kiln.ops.conv2d(symbol, kiln.from_torch(w), None, stride, pad), (0, 2, 3, 1))
    graph = optimize(kiln.trace_from(y, [symbol]))
    compiled = graph.compile()
    workspace = compiled.workspace_set()
    kiln_step = lambda: compiled.run([x], workspace)[0]
    w_cl = w.contiguous(memory_format=torch.channels_last)
    torch_step = lambda: F.conv2d(x.contiguous(memory_format=torch.channels_last), w_cl, stride=stride, padding=pad)
    reference = F.conv2d(x.double(), w.double(), stride=stride, padding=pad).permute(0, 2, 3, 1)
    return kiln_step, torch_step, kiln_step(), reference, " + ".join(n.name for n in graph.nodes)


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


def _sweep_settings(template, task, sms: int, level: int) -> list[dict]:
    """The knob settings `--sweep` times: the template's space at `level` and its first two
    suggestions (conv_sm90: no wider BN than the output channels need)."""
    widest = max(64, 1 << (task.outputs[0].shape[-1] - 1).bit_length())
    suggested = template.suggest(task, sms)[:2] if template.suggest else []
    return [dict(k) for k in dict.fromkeys(tuple(sorted(k.items())) for k in template.space(level) + suggested)
            if dict(k).get("BN", 0) <= widest]


def _summary(rows) -> None:
    for group, batch in dict.fromkeys((r["model"], r["batch"]) for r in rows):
        mine = [r for r in rows if (r["model"], r["batch"]) == (group, batch)]
        ratios = [r["ratio"] for r in mine]
        total_kiln, total_torch = (sum(r[key] * r["count"] for r in mine) for key in ("kiln_us", "torch_us"))
        print(f"{group} batch {batch}: geomean {math.exp(sum(map(math.log, ratios)) / len(ratios)):.3f}, "
              f"min {min(ratios):.3f}; all {sum(r['count'] for r in mine)} convs kiln {total_kiln:.0f} us, "
              f"torch {total_torch:.0f} us")


def main():
    from kiln.runtime import cuda as rt
    from kiln.schedule import schedules_for
    from kiln.schedule.tuner import candidates, tune
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", choices=sorted(SUITES), default="resnet50", help="which shapes")
    parser.add_argument("--batch", help="comma-separated batch sizes (resnet50: 1,32; depthwise: 1,8)")
    parser.add_argument("--level", type=int, default=0, help="Kiln's tuning level")
    parser.add_argument("--sweep", action="store_true", help="also time every knob setting of the chosen template")
    parser.add_argument("--sweep-level", type=int, default=1, help="the tuning level whose space --sweep times")
    parser.add_argument("--json", help="write the rows here")
    opts = parser.parse_args()
    shapes, batches = SUITES[opts.suite]
    gpu, sms = torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0).multi_processor_count
    arch = rt.arch_number(rt.device_info(0)["arch"])
    print(f"GPU: {gpu} ({sms} SMs), torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}", flush=True)
    cases = [(b, model, shape, count) for b in map(int, (opts.batch or batches).split(","))
             for model, shape, count in shapes()]
    built = [_case(b, *shape) for b, _, shape, _ in cases]
    chosen = []
    for task, *_ in built:
        template = schedules_for(task, "cuda", arch)[0]
        knobs = tune(task, template, kiln.device("cuda"), opts.level) if opts.level else \
            candidates(template, task, sms, 0)[0]
        chosen.append((template, knobs, template.render(task, **knobs)))
    sweeps = [[(k, template.render(task, **k)) for k in _sweep_settings(template, task, sms, opts.sweep_level)]
              for (task, *_), (template, _, _) in zip(built, chosen)] if opts.sweep else []
    build = lambda programs: rt.compile_many([(p.source, p.kernel_names[0], p.arch_for(rt.device_info(0)["arch"]))
                                              for p in programs])
    build([p for _, _, p in chosen])
    rows = []
    for n, ((batch, model, shape, count), (task, operands, torch_ops, kwargs, out_shape, work),
            (template, knobs, program)) in enumerate(zip(cases, built, chosen)):
        size, cin, cout, k, stride, pad, groups = shape
        if cin < 8 and groups == 1:
            kiln_step, torch_step, result, reference, steps = _first_layer(batch, *shape[:6])
            t_kiln, t_torch = _graph_time(kiln_step), _graph_time(torch_step)
            err = ((result.double() - reference).norm() / reference.norm()).item()
            name = f"{size}x{size} {cin}->{cout} k{k} s{stride} from NCHW"
            row = {"model": model, "batch": batch, "name": name, "count": count, "template": steps, "knobs": {},
                   "kiln_us": t_kiln * 1e6, "torch_us": t_torch * 1e6, "ratio": t_torch / t_kiln, "rel_err": err,
                   "kiln_tflops": work / t_kiln / 1e12}
            rows.append(row)
            print(f"b{batch:<3d} {name:26s} x{count} {steps}: kiln {row['kiln_us']:8.1f} us  torch "
                  f"{row['torch_us']:8.1f} us  ratio {row['ratio']:.3f}  err {err:.1e}", flush=True)
            continue
        reference = F.conv2d(*[t.double() for t in torch_ops], **kwargs).permute(0, 2, 3, 1)
        out = torch.empty(out_shape, dtype=torch.float16, device="cuda")
        t_kiln, err = _time_program(program, operands, out, reference)
        t_torch = _graph_time(lambda: F.conv2d(*torch_ops, **kwargs))
        name = f"{size}x{size} {cin}->{cout} k{k} s{stride}" if groups == 1 else f"{size}x{size}x{cin} dw k{k} s{stride}"
        row = {"model": model, "batch": batch, "name": name, "count": count, "template": template.name, "knobs": knobs,
               "kiln_us": t_kiln * 1e6, "torch_us": t_torch * 1e6, "ratio": t_torch / t_kiln, "rel_err": err}
        row.update({"kiln_tflops": work / t_kiln / 1e12} if groups == 1 else
                   {"kiln_gbs": work / t_kiln / 1e9, "torch_gbs": work / t_torch / 1e9})
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
        speed = f"{row['kiln_tflops']:6.1f} TF" if groups == 1 else f"{row['kiln_gbs']:6.0f} GB/s"
        print(f"b{batch:<3d} {name:26s} x{count} {template.name:9s} kiln {row['kiln_us']:8.1f} us {speed}  "
              f"torch {row['torch_us']:8.1f} us  ratio {row['ratio']:.3f}  err {err:.1e}", flush=True)
    _summary(rows)
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"gpu": gpu, "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(), "rows": rows},
                      f, indent=1)


if __name__ == "__main__":
    main()
