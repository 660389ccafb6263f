"""Training step time: eager PyTorch, torch.compile's default backend and Kiln.

Cases: ResNet-50 at batch 32 (float32 weights, bfloat16 autocast, SGD with momentum,
cross-entropy on random labels) and the Llama-style 1B model of `models_bench` (bfloat16 weights,
AdamW, next-token cross-entropy on 512 random tokens). A step is forward, backward and the
optimizer step; only the model is compiled. Each backend starts from the same weights; the
first step's loss is compared with eager's, then steps are timed (median of `--steps` after
three warm-up steps, CUDA events around each step).

    python benchmarks/train_bench.py [--cases resnet50_b32 llama_1b] [--steps 20] [--json out.json]
        [--backends eager inductor kiln] [--profile N]

`--profile N` prints the N kernels that take the most GPU time in two steps of each backend.
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import warnings

import torch
import torch.nn.functional as F

from models_bench import llama_1b, torchvision_model


def resnet50_case():
    model = torchvision_model("resnet50").cuda()
    images = torch.randn(32, 3, 224, 224, device="cuda")
    labels = torch.randint(0, 1000, (32,), device="cuda")

    def loss_of(m):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return F.cross_entropy(m(images).float(), labels)
    return model, loss_of, lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9)


def llama_case():
    model = llama_1b().to("cuda", torch.bfloat16)
    ids = torch.randint(0, 32000, (1, 513), device="cuda")

    def loss_of(m):
        logits = m(ids[:, :-1])
        return F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
    return model, loss_of, lambda params: torch.optim.AdamW(params, lr=1e-4)


CASES = {"resnet50_b32": resnet50_case, "llama_1b": llama_case}


def step_times(model, loss_of, make_optimizer, compiled, steps: int,
               profile: int = 0) -> tuple[float, float]:
    """(first step's loss, median milliseconds of a step); with `profile`, print the kernels that
    take the most GPU time in two more steps."""
    optimizer = make_optimizer(model.parameters())

    def step():
        loss = loss_of(compiled)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    first = step().item()
    for _ in range(2):
        step()
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    if profile:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(2):
                step()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=profile, max_name_column_width=70))
    return first, statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--json", help="write the rows to this file")
    parser.add_argument("--backends", nargs="+", default=["eager", "inductor", "kiln"])
    parser.add_argument("--profile", type=int, default=0, help="print this many top kernels per backend")
    args = parser.parse_args()
    warnings.simplefilter("ignore", FutureWarning)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    rows = []
    for name in args.cases:
        torch.manual_seed(0)
        model, loss_of, make_optimizer = CASES[name]()
        initial = copy.deepcopy(model.state_dict())
        row = {"case": name}
        for label in args.backends:
            backend = None if label == "eager" else label
            model.load_state_dict(initial)
            torch._dynamo.reset()
            compiled = model if backend is None else torch.compile(model, backend=backend)
            try:
                loss, ms = step_times(model, loss_of, make_optimizer, compiled, args.steps, args.profile)
            except Exception as exc:   # report the failure and go on
                row[f"{label}_error"] = f"{type(exc).__name__}: {exc}"
                print(f"{name:<14} {label:<9} FAILED: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                continue
            row[f"{label}_ms"], row[f"{label}_first_loss"] = ms, loss
            print(f"{name:<14} {label:<9} {ms:9.2f} ms/step   first loss {loss:.5f}", flush=True)
        rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
