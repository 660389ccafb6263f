"""gemm_sm90 knob settings against each other and torch (cuBLAS), in alternating rounds.

`gemm_bench.py --sweep` times each setting once, one after another; on an H200 the same kernel
then reads up to 10% apart from one minute to the next (the clock drifts with power draw). This
script times a few settings and torch on each of `gemm_bench.cases()`'s shapes in `--rounds`
alternating rounds (median of each), so that the comparison between settings holds. Every
setting is checked against a float64 reference first.
Usage: python3 benchmarks/gemm_ab.py [--only square,tf32] [--rounds 5] [--knobs '[{..}, ..]'] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
from dataclasses import replace

import torch

import kiln
from gemm_bench import _alternating_times, _task, cases
from kiln.runtime import cuda as rt
from kiln.runtime.backend import backend_for
from kiln_ops_builtin.templates import gemm_sm90

_wide = gemm_sm90.GemmKnobs.tile(128, 2, 2, 6, 1)
SETTINGS = [k.as_dict() for k in (gemm_sm90.COOPERATIVE, gemm_sm90.CLUSTERED, replace(gemm_sm90.COOPERATIVE, CLUSTER=2),
                                  _wide, replace(_wide, CLUSTER=2))]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="square,tf32", help="gemm_bench's groups to time")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--knobs", help="a JSON list of the settings to time (default: SETTINGS)")
    parser.add_argument("--json", help="write the rows here")
    opts = parser.parse_args()
    settings = json.loads(opts.knobs) if opts.knobs else SETTINGS
    device, rows = kiln.device("cuda"), []
    print(f"GPU: {torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)
    for group, name, op, args, reference, flops in cases():
        if group not in opts.only.split(","):
            continue
        torch.backends.cuda.matmul.allow_tf32 = group == "tf32"
        task = _task(op, args)
        programs = [gemm_sm90.render(task, **knobs) for knobs in settings]
        rt.compile_many([(p.source, p.kernel_names[0], "sm_90a") for p in programs])
        want = reference(*[a.double() for a in args])
        out = torch.empty(task.outputs[0].shape, dtype=args[0].dtype, device="cuda")
        runners = [backend_for(device).load(p, device) for p in programs]
        for knobs, runner in zip(settings, runners):
            out.fill_(float("nan"))
            runner(list(args), [out])
            err = ((out.double() - want).norm() / want.norm()).item()
            assert err < 1e-2, f"{name} {knobs}: relative error {err}"
        calls = [lambda r=r: r(list(args), [out]) for r in runners]
        t_torch, *times = _alternating_times(lambda: reference(*args), *calls, rounds=opts.rounds)
        print(f"== {group} {name} {str(args[0].dtype)[6:]}: torch {flops / t_torch / 1e12:.0f} TF", flush=True)
        for knobs, t in zip(settings, times):
            rows.append({"group": group, "name": name, "dtype": str(args[0].dtype)[6:], "knobs": knobs,
                         "tflops": flops / t / 1e12, "ratio": t_torch / t})
            print(f"   {str(knobs):66s} {flops / t / 1e12:7.1f} TF  ratio {t_torch / t:.3f}", flush=True)
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(0), "rounds": opts.rounds, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
