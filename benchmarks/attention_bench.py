"""Benchmark of Kiln's fused attention forward against torch's scaled_dot_product_attention (its
flash backend) on one GPU, in the same run.

The issue-12 shapes: (batch 8, 12 heads, seq 128, dim 64); (1, 32, 2048, 128, causal);
(4, 32 query heads / 8 KV heads, 4096, 128, causal); decoding (8, 32 / 8 heads, 1 query, 4096
keys, 128); long sequences at head dims 64 and 96; and more decoding (`attention_decode`'s
shapes): multi-head, 16 queries (speculative decoding), a 16k-key cache at head dim 64; the
models' own: ViT-B/16's 197 tokens, GPT-2's causal 1024 and the Llama-style 1B's causal 512
(32 query heads on 8 KV heads, batch 1). Each side
runs as a CUDA graph of REPS calls (launch gaps out of the numbers), timed with CUDA events,
median of several replays (`gemm_bench`'s timing). `--sweep` also times every knob setting of
the template's tuning level 2; `--shapes` picks shapes by name, `--template` times another
template that takes them (`attention_flash` on the decode shapes, `attention_sm90` on the others
on an H100 or H200). Prints the GPU's name and a table; `--json PATH` writes every row.
Usage: python3 benchmarks/attention_bench.py [--sweep] [--shapes decode,decode-mha] [--template NAME]
       [--json out.json]
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import kiln
from gemm_bench import _graph_time as graph_time
from kiln.plugins.registry import registry

SHAPES = [  # name, batch, query heads, kv heads, Lq, Lk, dim, causal
    ("bert", 8, 12, 12, 128, 128, 64, False),
    ("causal-2k", 1, 32, 32, 2048, 2048, 128, True),
    ("gqa-4k", 4, 32, 8, 4096, 4096, 128, True),
    ("decode", 8, 32, 8, 1, 4096, 128, False),
    ("d64-2k", 4, 16, 16, 2048, 2048, 64, True),         # the other head dims, long
    ("d96-2k", 2, 16, 16, 2048, 2048, 96, False),
    ("decode-mha", 8, 32, 32, 1, 4096, 128, False),
    ("decode-q16", 4, 32, 8, 16, 4096, 128, False),
    ("decode-d64-16k", 4, 16, 4, 1, 16384, 64, False),
    ("vit", 8, 12, 12, 197, 197, 64, False),              # ViT-B/16: just past one key tile
    ("gpt2-1k", 1, 12, 12, 1024, 1024, 64, True),
    ("llama-512", 1, 32, 8, 512, 512, 64, True),          # the Llama-style 1B's batch-1 prefill (issue 31)
]


def _task(q, k, v, causal):
    definition = registry().operator("attention")
    args = {"is_causal": causal}
    return definition.task(definition.bind([kiln.from_torch(t) for t in (q, k, v)], args))[0]


def _flops(b, hq, lq, lk, d, causal):
    pairs = sum(min(i + 1, lk) for i in range(lq)) if causal else lq * lk
    return 4 * b * hq * pairs * d


def _torch_flash(q, k, v, causal):
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])


def _runner(template, task, knobs):
    """The loaded program of `template` for `task` and the name of its attention kernel."""
    from kiln.runtime.backend import backend_for
    program = template.render(task, **knobs)
    return backend_for(kiln.device("cuda")).load(program, kiln.device("cuda")), program.launches[0].kernel


def _registers(runner, kernel) -> tuple[int, int]:
    """Registers per thread and local-memory (spill) bytes of the loaded kernel named `kernel`."""
    from cuda.bindings import driver
    fn = runner.kernels[kernel]._fn
    attr = driver.CUfunction_attribute
    return (driver.cuFuncGetAttribute(attr.CU_FUNC_ATTRIBUTE_NUM_REGS, fn)[1],
            driver.cuFuncGetAttribute(attr.CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, fn)[1])


def _case(name, b, hq, hkv, lq, lk, d, causal, dtype, sweep, template_name=None):
    from kiln.schedule import schedules_for
    from kiln.schedule.tuner import candidates
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=dtype) for h, n in ((hq, lq), (hkv, lk), (hkv, lk)))
    task = _task(q, k, v, causal)
    templates = schedules_for(task, "cuda", 90)
    template = next((t for t in templates if t.name == template_name), None) if template_name else templates[0]
    if template is None:
        raise ValueError(f"{template_name} does not take this shape (these do: {[t.name for t in templates]})")
    knobs = candidates(template, task, torch.cuda.get_device_properties(0).multi_processor_count, 0)[0]
    out = torch.empty(task.outputs[0].shape, dtype=dtype, device="cuda")
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal,
                                         enable_gqa=hq != hkv)
    flops = _flops(b, hq, lq, lk, d, causal)

    def measure(settings):
        runner, kernel = _runner(template, task, settings)
        out.fill_(float("nan"))
        runner([q, k, v], [out])
        err = ((out.double() - ref).norm() / ref.norm()).item()
        regs = _registers(runner, kernel)
        return graph_time(lambda: runner([q, k, v], [out])), err, regs

    t_kiln, err, regs = measure(knobs)
    t_torch = graph_time(lambda: _torch_flash(q, k, v, causal))
    row = {"name": name, "shape": [b, hq, hkv, lq, lk, d], "causal": causal, "dtype": str(dtype)[6:],
           "template": template.name, "knobs": knobs, "kiln_us": t_kiln * 1e6, "torch_us": t_torch * 1e6,
           "kiln_tflops": flops / t_kiln / 1e12, "torch_tflops": flops / t_torch / 1e12,
           "ratio": t_torch / t_kiln, "rel_err": err, "regs_spill": regs}
    if sweep:
        from kiln.runtime import cuda as rt
        programs = [template.render(task, **s) for s in template.space(2) + [knobs]]
        rt.compile_many([(p.source, template.name, p.arch_for(rt.device_info(0)["arch"])) for p in programs])
        found = []
        for settings in template.space(2) + [knobs] * (knobs not in template.space(2)):
            t, e, r = measure(settings)
            found.append({"knobs": settings, "us": t * 1e6, "ratio": t_torch / t, "rel_err": e, "regs_spill": r})
        row["sweep"] = sorted(found, key=lambda f: f["us"])
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--sweep", action="store_true", help="also time every level-2 knob setting")
    parser.add_argument("--dtypes", default="float16,bfloat16")
    parser.add_argument("--shapes", default=",".join(s[0] for s in SHAPES), help="names of the shapes to time")
    parser.add_argument("--template", help="time this template (e.g. attention_flash) instead of the one Kiln picks")
    opts = parser.parse_args()
    gpu = torch.cuda.get_device_name(0)
    print(f"GPU: {gpu}, torch {torch.__version__}", flush=True)
    rows = []
    for dtype in [getattr(torch, n) for n in opts.dtypes.split(",")]:
        for shape in [s for s in SHAPES if s[0] in opts.shapes.split(",")]:
            try:
                row = _case(*shape, dtype, opts.sweep, opts.template)
            except Exception as exc:         # a shape one side cannot run: reported, the others still timed
                print(f"{shape[0]:10s} {str(dtype)[6:]:9s} FAILED: {type(exc).__name__}: {exc}", flush=True)
                rows.append({"name": shape[0], "dtype": str(dtype)[6:], "error": f"{type(exc).__name__}: {exc}"})
                continue
            rows.append(row)
            print(f"{row['name']:10s} {row['dtype']:9s} {row['template']:16s} {row['knobs']}  "
                  f"kiln {row['kiln_us']:9.1f} us "
                  f"{row['kiln_tflops']:6.1f} TF  torch {row['torch_us']:9.1f} us {row['torch_tflops']:6.1f} TF  "
                  f"ratio {row['ratio']:.3f}  err {row['rel_err']:.1e}  regs/spill {row['regs_spill']}", flush=True)
            for s in row.get("sweep", []):
                print(f"    {s['knobs']} {s['us']:9.1f} us ratio {s['ratio']:.3f} err {s['rel_err']:.1e} "
                      f"regs/spill {s['regs_spill']}", flush=True)
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"gpu": gpu, "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
