"""Training step time and peak memory: eager PyTorch, torch.compile's default backend and Kiln.

Cases (issue 32): GPT-2 small at batch 8 x 512 tokens (LM head and cross-entropy inside the
model, bfloat16 autocast, fused AdamW, dropout off as in nanoGPT, so that losses compare), the Llama-style 1B model of `models_bench` (bfloat16
weights, fused AdamW, next-token cross-entropy on 512 tokens), ResNet-50 at batch 32 in
channels_last (bfloat16 autocast, SGD with momentum) and ViT-B/16 at batch 32 (bfloat16
autocast, fused AdamW). A step is forward, backward and the optimizer step; only the model is
compiled. Every backend starts from the same weights and batch and runs `--loss-steps` steps
whose losses are kept (they also warm up), then `--steps` timed steps (median, CUDA events
around each step). Peak memory is `torch.cuda.max_memory_allocated` over all of a backend's steps.

    python benchmarks/train_bench.py [--cases gpt2_b8 ...] [--steps 10] [--loss-steps 20]
        [--backends eager inductor kiln] [--json out_train.json] [--profile N] [--kernels N]
        [--fp32-reference] [--seeds 0 ...]

`--profile N` prints the N kernels that take the most GPU time in two steps of each backend;
`--kernels N` times each step of Kiln's forward and backward graphs in place (CUDA graphs off,
`kernel_times.time_steps`) and prints the N heaviest with their operator and shapes.
`--fp32-reference` also trains eagerly in float32 (autocast off) from the same weights
(`--seeds`: each case runs once for each seed of its starting weights and batch, to tell a
backend's rounding from one run's chaos): under 16-bit autocast every backend's rounding
differs from eager's by about eager's own error (on the CPU a small ViT's bf16 logits are
5.3e-3 from float64's for eager and for Kiln, and 4.4e-3 from each other), so a distance from
eager's losses says less than one from float32's.
"""
from __future__ import annotations

import argparse
import collections
import copy
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import warnings

import torch
import torch.nn.functional as F

from kernel_times import describe, graph_runs, time_steps
from models_bench import llama_1b, torchvision_model


AUTOCAST = {"enabled": True}     # off for the float32 reference (`--fp32-reference`)


def gpt2_case():
    from transformers import GPT2Config, GPT2LMHeadModel
    model = GPT2LMHeadModel(GPT2Config(use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)).cuda()
    ids = torch.randint(0, 50257, (8, 512), device="cuda")

    def loss_of(m):
        with torch.autocast("cuda", dtype=torch.bfloat16, **AUTOCAST):
            return m(input_ids=ids, labels=ids).loss
    return model, loss_of, lambda params: torch.optim.AdamW(params, lr=1e-4, fused=True)


def llama_case():
    model = llama_1b().to("cuda", torch.bfloat16)
    ids = torch.randint(0, 32000, (1, 513), device="cuda")

    def loss_of(m):
        logits = m(ids[:, :-1])
        return F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
    return model, loss_of, lambda params: torch.optim.AdamW(params, lr=1e-4, fused=True)


def image_case(name: str, make_optimizer, channels_last: bool):
    def case():
        model = torchvision_model(name).cuda()
        images = torch.randn(32, 3, 224, 224, device="cuda")
        if channels_last:
            model, images = model.to(memory_format=torch.channels_last), images.to(memory_format=torch.channels_last)
        labels = torch.randint(0, 1000, (32,), device="cuda")

        def loss_of(m):
            with torch.autocast("cuda", dtype=torch.bfloat16, **AUTOCAST):
                return F.cross_entropy(m(images).float(), labels)
        return model, loss_of, make_optimizer
    return case


CASES = {
    "gpt2_b8": gpt2_case,
    "llama_1b": llama_case,
    "resnet50_b32_cl": image_case("resnet50", lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9), True),
    "resnet50_b32": image_case("resnet50", lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9), False),
    "vit_b16_b32": image_case("vit_b_16", lambda p: torch.optim.AdamW(p, lr=1e-4, fused=True), False),
}
DEFAULT_CASES = ["gpt2_b8", "llama_1b", "resnet50_b32_cl", "vit_b16_b32"]
BACKENDS = {    # label: torch.compile's keywords (None: the model run eagerly)
    "eager": None,
    "inductor": {"backend": "inductor"},
    "inductor_cg": {"backend": "inductor", "mode": "reduce-overhead"},
    "kiln": {"backend": "kiln"},
    "kiln_nocg": {"backend": "kiln", "options": {"use_cuda_graph": False}},
    "kiln_keep_saved": {"backend": "kiln", "options": {"reuse_saved_memory": False}},
}


def train(model, loss_of, make_optimizer, compiled, loss_steps: int, steps: int, profile: int = 0) -> dict:
    """Losses of the first `loss_steps` steps, the median milliseconds of `steps` more and the
    peak memory over them (also above what was allocated at the start: the model, and whatever
    earlier backends left in the process, such as Inductor's CUDA-graph pool); with `profile`,
    print the kernels that take the most GPU time in two more steps."""
    optimizer = make_optimizer(model.parameters())

    def step():
        torch.compiler.cudagraph_mark_step_begin()   # Inductor's CUDA graphs: a new step may reuse outputs
        loss = loss_of(compiled)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach().clone()

    torch.cuda.reset_peak_memory_stats()
    allocated_at_start = torch.cuda.memory_allocated()
    losses = [step() for _ in range(loss_steps)]
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    result = {"ms": statistics.median(times) if times else None, "peak_gb": torch.cuda.max_memory_allocated() / 1e9,
              "peak_above_start_gb": (torch.cuda.max_memory_allocated() - allocated_at_start) / 1e9,
              "losses": [x.item() for x in losses]}
    if profile:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(2):
                step()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=profile, max_name_column_width=70))
        result["kernels_per_step"] = sum(e.count for e in prof.key_averages() if e.device_type.name == "CUDA") / 2
    return result


def kiln_kernels(model, loss_of, top: int) -> dict:
    """Every step of Kiln's forward and backward graphs of one training step timed in place (CUDA
    graphs off): microseconds summed by operator and the `top` heaviest steps."""
    import kiln
    kiln.torch.dynamo_config.use_cuda_graph(False)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="kiln")

    def step():
        loss_of(compiled).backward()
        model.zero_grad(set_to_none=True)
    step()
    rows = []
    for graph, inputs in graph_runs(step):
        rows += [dict(describe(s), us=round(us, 2), step=s) for s, us in zip(graph.steps, time_steps(graph, inputs))]
    kiln.torch.dynamo_config.use_cuda_graph(True)
    by_operator = collections.defaultdict(lambda: [0, 0.0])
    for r in rows:
        by_operator[r["operator"]][0] += 1
        by_operator[r["operator"]][1] += r["us"]
    print(f"  kiln: {len(rows)} steps, {sum(r['us'] for r in rows) / 1e3:.2f} ms of kernels timed alone")
    for op, (n, us) in sorted(by_operator.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"  {us:>10.1f} us {n:>5}x  {op}")
    print("  heaviest steps:")
    heaviest = sorted(rows, key=lambda r: -r["us"])[:top]
    for r in heaviest:
        print(f"  {r['us']:>9.1f} us  {r['operator']:<24} {r['shapes']} {','.join(r['kernels'])}")
        program = getattr(getattr(r.pop("step").kernel, "kernel", None), "program", None)
        r["source"] = getattr(program, "source", None)
    return {"steps": len(rows), "top": heaviest,
            "by_operator": {op: {"steps": n, "us": round(us, 1)} for op, (n, us) in by_operator.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=DEFAULT_CASES, choices=list(CASES))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--loss-steps", type=int, default=20)
    parser.add_argument("--json", help="write the rows to this file")
    parser.add_argument("--backends", nargs="+", default=["eager", "inductor", "kiln"], choices=list(BACKENDS))
    parser.add_argument("--profile", type=int, default=0, help="print this many top kernels per backend")
    parser.add_argument("--kernels", type=int, default=0, help="time Kiln's steps alone, print this many")
    parser.add_argument("--fp32-reference", action="store_true",
                        help="also train eagerly in float32 (autocast off, float32 weights) from the same "
                             "weights and report each backend's largest loss difference from that run")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0],
                        help="seeds of the starting weights and batch: each case runs once for each")
    parser.add_argument("--isolate", action="store_true",
                        help="train each backend in a process of its own (peaks free of what earlier runs "
                             "left allocated, or freed during a later one)")
    args = parser.parse_args()
    if args.isolate:
        return isolated(args)
    warnings.simplefilter("ignore", FutureWarning)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    rows = []
    for name, seed in [(name, seed) for name in args.cases for seed in args.seeds]:
        torch.manual_seed(seed)
        model, loss_of, make_optimizer = CASES[name]()
        initial = copy.deepcopy(model.state_dict())
        row = {"case": name, "seed": seed}
        tag = name if args.seeds == [0] else f"{name}/seed {seed}"
        for label in args.backends:
            model.load_state_dict(initial)
            torch._dynamo.reset()
            gc.collect()
            torch.cuda.empty_cache()
            compiled = model if BACKENDS[label] is None else torch.compile(model, **BACKENDS[label])
            try:
                r = train(model, loss_of, make_optimizer, compiled, args.loss_steps, args.steps, args.profile)
            except Exception as exc:   # report the failure and go on
                row[f"{label}_error"] = f"{type(exc).__name__}: {exc}"
                print(f"{tag:<16} {label:<9} FAILED: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                continue
            for key, value in r.items():
                row[f"{label}_{key}"] = value
            print(f"{tag:<16} {label:<9} {r['ms']:9.2f} ms/step  peak {r['peak_gb']:6.2f} GB "
                  f"({r['peak_above_start_gb']:5.2f} above the start)  "
                  f"losses {r['losses'][0]:.5f} .. {r['losses'][-1]:.5f}", flush=True)
        if args.fp32_reference:
            reference = copy.deepcopy(model).float()
            reference.load_state_dict(initial)
            AUTOCAST["enabled"] = False
            try:
                losses = train(reference, loss_of, make_optimizer, reference, args.loss_steps, 0)["losses"]
            finally:
                AUTOCAST["enabled"] = True
            del reference
            row["fp32_losses"] = losses
            for label in args.backends:
                if f"{label}_losses" in row:
                    row[f"{label}_max_loss_diff_fp32"] = max(abs(a - b) / abs(b) for a, b in
                                                             zip(row[f"{label}_losses"], losses))
                    print(f"  {label}: largest relative loss difference from eager float32 "
                          f"{row[f'{label}_max_loss_diff_fp32']:.2e}")
        if "eager_losses" in row:
            for label in args.backends[1:]:
                if f"{label}_losses" in row:
                    row[f"{label}_max_loss_diff"] = max(abs(a - b) for a, b in zip(row[f"{label}_losses"],
                                                                                     row["eager_losses"]))
                    print(f"  {label}: largest loss difference from eager over {args.loss_steps} steps "
                          f"{row[f'{label}_max_loss_diff']:.2e}")
        if args.kernels:
            model.load_state_dict(initial)
            row["kiln_kernels"] = kiln_kernels(model, loss_of, args.kernels)
        rows.append(row)
        del model, initial
        if args.json:       # after each case, so that a run cut short keeps what it measured
            with open(args.json, "w") as f:
                json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


def isolated(args) -> None:
    """Each (case, backend) of `args` trained by this script in a process of its own; the rows
    merged into `args.json`."""
    rows = []
    for name, seed in [(name, seed) for name in args.cases for seed in args.seeds]:
        row = {"case": name, "seed": seed}
        for label in args.backends:
            with tempfile.TemporaryDirectory() as tmp:
                out = os.path.join(tmp, "row.json")
                subprocess.run([sys.executable, __file__, "--cases", name, "--backends", label, "--json", out,
                                "--steps", str(args.steps), "--loss-steps", str(args.loss_steps),
                                "--seeds", str(seed)], check=False)
                if os.path.exists(out):
                    with open(out) as f:
                        row.update({k: v for k, v in json.load(f)["rows"][0].items() if k not in ("case", "seed")})
                else:
                    row[f"{label}_error"] = "the process ended without a result"
        rows.append(row)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "isolated": True,
                           "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
