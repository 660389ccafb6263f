"""A grid of `conv_depthwise_nhwc` knob settings timed on every shape of `conv_bench.py --suite
depthwise`: the data `conv_depthwise_nhwc.suggest` is fitted to.

Per shape and batch size: torch's time (cuDNN, channels_last), the time of `suggest`'s first
setting, and of every setting of the grid (channels 16 to 128 a block, 1 to 8 pixels a thread,
rows x strips of threads from 2 x 4 to 8 x 4), each clamped to the shape as `render` does and
timed once. Every result is checked against a float64 reference. Prints the first choice's and
the best setting's ratio to torch; `--json` writes every time.
Usage: python3 benchmarks/depthwise_grid.py [--batch 8,1] [--json grid.json]
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

import conv_bench as cb
from kiln.runtime import cuda as rt
from kiln_ops_builtin.templates import conv_depthwise_nhwc as dw

KNOBS = ("CB", "PX", "TX", "TH")
GRID = [dict(zip(KNOBS, (cbk, px, tx, th))) for cbk in (16, 32, 64, 96, 128) for px in (1, 2, 4, 8)
        for tx, th in ((2, 4), (2, 8), (2, 16), (4, 4), (4, 8), (8, 2), (8, 4))]


def settings(conv, first: dict) -> list[dict]:
    """`first`, then the grid, each clamped to the convolution (`_fit`), once each."""
    out = []
    for knobs in [first] + GRID:
        fitted = dw._fit(conv, **knobs)
        if fitted is not None and (clamped := {k: fitted[k] for k in KNOBS}) not in out:
            out.append(clamped)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", default="8,1", help="comma-separated batch sizes")
    parser.add_argument("--json", help="write every time here")
    opts = parser.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    arch = rt.device_info(0)["arch"]
    rows = []
    for batch in map(int, opts.batch.split(",")):
        for model, shape, count in cb.SUITES["depthwise"][0]():
            task, operands, torch_ops, kwargs, out_shape, _ = cb._case(batch, *shape)
            programs = [(k, dw.render(task, **k)) for k in settings(dw.match_conv_nhwc(task), dw.suggest(task, sms)[0])]
            rt.compile_many([(p.source, p.kernel_names[0], p.arch_for(arch)) for _, p in programs])
            reference = F.conv2d(*[t.double() for t in torch_ops], **kwargs).permute(0, 2, 3, 1)
            t_torch = cb._graph_time(lambda: F.conv2d(*torch_ops, **kwargs))
            out = torch.empty(out_shape, dtype=torch.float16, device="cuda")
            times = []
            for knobs, program in programs:
                t, err = cb._time_program(program, operands, out, reference)
                if err > 1e-2:
                    raise AssertionError(f"{shape} batch {batch} {knobs}: relative error {err}")
                times.append({"knobs": knobs, "us": t * 1e6})
            best = min(times, key=lambda r: r["us"])
            size, c, _, k, stride = shape[:5]
            print(f"b{batch} {model[:12]:12s} {size}x{size}x{c} k{k} s{stride}: torch {t_torch * 1e6:.1f} us, "
                  f"first {times[0]['knobs']} {t_torch * 1e6 / times[0]['us']:.3f}, "
                  f"best {best['knobs']} {t_torch * 1e6 / best['us']:.3f} ({len(times)} settings)", flush=True)
            rows.append({"model": model, "shape": shape, "count": count, "batch": batch, "torch_us": t_torch * 1e6,
                         "first": times[0]["knobs"], "times": times})
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
