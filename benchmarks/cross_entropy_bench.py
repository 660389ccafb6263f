"""The cross-entropy end of a causal LM's training step on the GPU: transformers' loss
(`ForCausalLMLoss`: bf16 logits upcast, labels shifted with -100, mean over the tokens) forward
and backward, alone, as GPT-2's step compiles it (the loss is a graph of its own there).

Prints the step's milliseconds for eager PyTorch, torch.compile's default backend and Kiln
(median over CUDA events around forward + backward), then each kernel of Kiln's forward and
backward graphs timed alone (`kernel_times.time_steps`: inputs may stay in the L2 cache) with
the bytes its tensors hold and the bandwidth that gives.

    python benchmarks/cross_entropy_bench.py [--rows 4096] [--vocab 50257] [--steps 20]
        [--backends eager inductor kiln] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch
from transformers.loss.loss_utils import ForCausalLMLoss

from kernel_times import describe, graph_runs, time_steps


def step_ms(fn, logits, labels, steps: int) -> float:
    """Median milliseconds of forward + backward of `fn` (warmed up first)."""
    samples = []
    for k in range(steps + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(logits, labels).backward()
        end.record()
        end.synchronize()
        if k >= 3:
            samples.append(start.elapsed_time(end))
    return statistics.median(samples)


def kiln_kernels(fn, logits, labels) -> list[dict]:
    """Each step of Kiln's graphs for one forward + backward, timed alone, with its bytes."""
    rows = []
    for graph, inputs in graph_runs(lambda: fn(logits, labels).backward()):
        for step, us in zip(graph.steps, time_steps(graph, inputs)):
            row = describe(step)
            task = getattr(step.kernel, "task", None)
            tensors = [*task.inputs, *task.outputs] if task is not None else []
            nbytes = sum(t.dtype.nbytes * int(torch.Size(t.shape).numel()) for t in tensors)
            rows.append(dict(row, us=round(us, 2), mb=round(nbytes / 1e6, 1),
                             gb_s=round(nbytes / us / 1e3, 0) if us else None))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--backends", nargs="+", default=["eager", "inductor", "kiln"])
    parser.add_argument("--json", help="write the results to this file")
    args = parser.parse_args()
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}; logits [{args.rows}, {args.vocab}] bf16")
    torch.manual_seed(0)
    batch = args.rows // 512 or 1
    logits = (torch.randn(batch, args.rows // batch, args.vocab, device="cuda") * 2).bfloat16().requires_grad_()
    labels = torch.randint(0, args.vocab, (batch, args.rows // batch), device="cuda")

    def loss(x, y):
        return ForCausalLMLoss(x, y, args.vocab)

    out = {"rows": args.rows, "vocab": args.vocab, "ms": {}}
    for backend in args.backends:
        torch._dynamo.reset()
        fn = loss if backend == "eager" else torch.compile(loss, backend=backend)
        out["ms"][backend] = round(step_ms(fn, logits, labels, args.steps), 3)
        print(f"{backend:>9}: {out['ms'][backend]:.3f} ms forward + backward", flush=True)
        if backend == "kiln":
            torch._dynamo.reset()
            fn = torch.compile(loss, backend="kiln", options={"use_cuda_graph": False})
            out["kernels"] = kiln_kernels(fn, logits, labels)
            for r in out["kernels"]:
                print(f"   {r['us']:>9.1f} us {r['mb']:>8.1f} MB {r['gb_s'] or 0:>6.0f} GB/s  {r['operator']:<12} "
                      f"{r['shapes']} {','.join(r['kernels'])}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
