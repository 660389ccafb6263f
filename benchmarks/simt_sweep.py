"""Every knob setting of the float32 SIMT GEMM (`matmul_simt`: level 2, its suggestions and a
few more split-K counts) against cuBLAS with TF32 off, on 4096^3 (x @ W and x @ W.T) and the
BERT-base linears. Every program is compiled first (in parallel), then each runs as a CUDA graph
(`gemm_bench._graph_time`) after a check against a float64 reference. Prints, per shape, cuBLAS's
time, the ratio (cuBLAS time / Kiln time) of the level-0 choice (`suggest`'s first) and the five
best settings.
Usage: python3 benchmarks/simt_sweep.py [--only 4096]
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kiln  # noqa: E402
from gemm_bench import _graph_time, _r, _task  # noqa: E402
from kiln.runtime import cuda as rt  # noqa: E402
from kiln.runtime.backend import backend_for  # noqa: E402
from kiln_ops_builtin.templates import matmul_simt as ms  # noqa: E402

F32 = torch.float32
EXTRA = [replace(tile, SPLIT=s).as_dict() for tile, splits in ((ms.WIDE, (2, 3, 4)), (ms.TILE_64x64, (3, 4, 6)),
                                                               (ms.TILE_64x128, (2, 4))) for s in splits]


def cases():
    """(name, operator, inputs, torch function, flops)."""
    lin = torch.nn.functional.linear
    n = 4096
    yield f"{n}^3 x@W", "matmul", (_r(n, n, dtype=F32), _r(n, n, dtype=F32)), torch.matmul, 2 * n ** 3
    yield f"{n}^3 x@W.T", "linear", (_r(n, n, dtype=F32), _r(n, n, dtype=F32)), lin, 2 * n ** 3
    for M, K, N in ((128, 768, 768), (128, 768, 2304), (128, 768, 3072), (128, 3072, 768), (1024, 768, 768)):
        yield (f"{M}x{K}x{N} x@W.T+b", "linear", (_r(M, K, dtype=F32), _r(N, K, dtype=F32), _r(N, dtype=F32)), lin,
               2 * M * N * K)


def settings_for(task, sm_count: int) -> list[dict]:
    """The level-0 choice first, then the rest of the suggestions, level 2 and EXTRA, once each."""
    out = []
    for k in ms.suggest(task, sm_count)[:3] + ms.TEMPLATE.space(2) + EXTRA:
        if k not in out:
            out.append(k)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="run the shapes whose name contains this")
    opts = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = kiln.device("cuda")
    info = rt.device_info(0)
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name(0)}, {sm} SMs, TF32 off")
    plans = []
    for name, op, args, ref_fn, flops in cases():
        if opts.only not in name:
            continue
        task = _task(op, args)
        programs = [(k, ms.render(task, **k)) for k in settings_for(task, sm)]
        plans.append((name, args, ref_fn, flops, task, programs))
    rt.compile_many([(p.source, p.kernel_names[0], p.arch_for(info["arch"]))
                     for *_, programs in plans for _, p in programs])
    for name, args, ref_fn, flops, task, programs in plans:
        ref = ref_fn(*[a.double() for a in args])
        t_torch = _graph_time(lambda: ref_fn(*args))
        out = torch.empty(task.outputs[0].shape, dtype=F32, device="cuda")
        rows = []
        for k, p in programs:
            run = backend_for(dev).load(p, dev)
            out.fill_(float("nan"))
            run(list(args), [out])
            err = ((out.double() - ref).norm() / ref.norm()).item()
            t = _graph_time(lambda: run(list(args), [out]))
            rows.append((t_torch / t, k, t, err))
        level0 = rows[0]
        print(f"{name}: cuBLAS {t_torch * 1e6:.1f} us ({flops / t_torch / 1e12:.1f} TFLOP/s); level 0 {level0[1]} "
              f"ratio {level0[0]:.3f} (err {level0[3]:.1e})")
        for ratio, k, t, err in sorted(rows, key=lambda r: -r[0])[:5]:
            print(f"    {ratio:.3f}  {t * 1e6:8.1f} us  {flops / t / 1e12:5.1f} TFLOP/s  {k}  err {err:.1e}")
        bad = [r for r in rows if not r[3] < 1e-5]
        for ratio, k, t, err in bad:
            print(f"    WRONG: {k} relative error {err:.1e}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
