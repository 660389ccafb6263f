"""End-to-end latency of whole models: eager PyTorch, torch.compile's default backend and Kiln.

By default ResNet-50 (batch 1, 224x224), BERT-base and GPT-2 (batch 1, 128 tokens); `--models`
adds the issues' suite (ResNet-18, ResNet-50 at batch 32, MobileNetV3-large, ConvNeXt-tiny,
EfficientNet-B0 and ViT-B/16 at batch 8, BERT at batch 8, a Llama-style 1B at 512 tokens).
Random weights, in one process on one GPU. Each compiled model is checked against eager before it
is timed. Times are medians of CUDA-event timings of single forward passes after warm-up; with
`--rounds N` eager and the backends are timed in turn N times and each reports the median of its
rounds (the machine's speed drifts over a run: single runs at batch 1 differed by 20%). Kiln replays CUDA graphs by
default; torch.compile's default backend (inductor) is timed in its default mode, which launches
kernels one by one, and in mode="reduce-overhead", which replays CUDA graphs too. TF32 is off
everywhere, so float32 means float32; `--tf32` turns it on for every backend (torch's matmul and
cuDNN flags, which Kiln follows), for float32 matmuls and convolutions on TF32 tensor cores.

    python benchmarks/models_bench.py [--models resnet50 bert gpt2 ...] [--dtype float32 float16 bfloat16]
        [--rounds N] [--tf32] [--host] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch.utils._pytree import tree_leaves

from kernel_counts import bert_base, randomize_batch_norm, resnet50


def gpt2() -> torch.nn.Module:
    """GPT-2 (124M) from transformers, randomly initialized, returning logits only."""
    from transformers import GPT2Config, GPT2LMHeadModel

    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = GPT2LMHeadModel(GPT2Config(attn_implementation="eager", use_cache=False))

        def forward(self, ids):
            return self.model(ids).logits

    return Logits()


def torchvision_model(name: str) -> torch.nn.Module:
    """A torchvision model, randomly initialized; parameters initialized to zeros (ViT's
    classification head) get random values, or every output would be zero and compare equal."""
    import torchvision
    model = getattr(torchvision.models, name)()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim > 1 and not p.any():
                p.normal_(0, p.shape[-1] ** -0.5)
    return model


def llama_1b() -> torch.nn.Module:
    """A Llama-style 1B model from transformers (8 layers, hidden 2048, 32 heads, 8 KV heads,
    vocabulary 32000), randomly initialized, returning logits only."""
    from transformers import LlamaConfig, LlamaForCausalLM

    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            config = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
                                 num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                                 attn_implementation="eager", use_cache=False)
            self.model = LlamaForCausalLM(config)

        def forward(self, ids):
            return self.model(ids).logits

    return Logits()


def _images(batch: int, size: int = 224):
    return lambda dt: (torch.randn(batch, 3, size, size, dtype=dt),)


def _tokens(batch: int, length: int, vocab: int):
    return lambda dt: (torch.randint(0, vocab, (batch, length)),)


CASES = {
    "resnet50": lambda: (resnet50(), _images(1)),
    "resnet50_b32": lambda: (resnet50(), _images(32)),
    "resnet18": lambda: (torchvision_model("resnet18"), _images(1)),
    "mobilenet_v3": lambda: (torchvision_model("mobilenet_v3_large"), _images(1)),
    "convnext_tiny_b8": lambda: (torchvision_model("convnext_tiny"), _images(8)),
    "efficientnet_b0_b8": lambda: (torchvision_model("efficientnet_b0"), _images(8)),
    "vit_b16_b8": lambda: (torchvision_model("vit_b_16"), _images(8)),
    "bert": lambda: (bert_base(), _tokens(1, 128, 30522)),
    "bert_b8": lambda: (bert_base(), _tokens(8, 128, 30522)),
    "gpt2": lambda: (gpt2(), _tokens(1, 128, 50257)),
    "llama_1b": lambda: (llama_1b(), _tokens(1, 512, 32000)),
}
DEFAULT_CASES = ["resnet50", "bert", "gpt2"]


def timed(fn, inputs, repeats: int = 50) -> float:
    """Median milliseconds of one call, after warm-up."""
    for _ in range(5):
        fn(*inputs)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*inputs)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def host_timing(fn, inputs, calls: int = 300) -> dict:
    """A call's cost on the host and in a loop, without synchronizing between calls: the median
    microseconds the host spends issuing one call (`host_us`), and the microseconds per call of
    `calls` calls issued back to back, up to the end of the last one's GPU work (`loop_us`: the
    larger of the host's and the GPU's time per call)."""
    for _ in range(5):
        fn(*inputs)
    torch.cuda.synchronize()
    host = []
    start = time.perf_counter()
    for _ in range(calls):
        t = time.perf_counter()
        fn(*inputs)
        host.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    return {"host_us": statistics.median(host) * 1e6, "loop_us": (time.perf_counter() - start) / calls * 1e6}


def max_error(got, want) -> float:
    """Largest absolute difference over the tensors of two outputs, relative to the reference scale."""
    worst = 0.0
    for g, w in zip(tree_leaves(got), tree_leaves(want)):
        if isinstance(w, torch.Tensor) and w.is_floating_point():
            scale = w.float().abs().max().item() or 1.0
            worst = max(worst, (g.float() - w.float()).abs().max().item() / scale)
    return worst


def run_case(name: str, dtype: torch.dtype, rounds: int = 1, host: bool = False) -> dict:
    """Compile the model with each backend (checked against eager), then time eager and every
    backend in turn, `rounds` times over: each backend's time is the median of its rounds, so
    that a drift of the machine's speed over the run touches all of them alike. With `host`,
    each backend's `host_timing` too (`<label>_host_us`, `<label>_loop_us`), once, after the
    rounds."""
    torch.manual_seed(0)
    model, make_inputs = CASES[name]()
    randomize_batch_norm(model)
    model = model.to("cuda", dtype).eval()
    inputs = tuple(x.cuda() for x in make_inputs(dtype))
    row = {"model": name, "dtype": str(dtype).replace("torch.", ""), "rounds": rounds,
           "tf32": torch.backends.cudnn.allow_tf32}
    with torch.no_grad():
        want = model(*inputs)
        runs = {"eager": model}
        torch._dynamo.reset()
        # no reset between backends: dynamo keeps each backend's graphs under a guard on the backend
        for backend, label, mode in (("kiln", "kiln", None), ("inductor", "inductor", None),
                                     ("inductor", "inductor_cg", "reduce-overhead")):
            compiled = runs[label] = torch.compile(model, backend=backend, mode=mode)
            start = time.perf_counter()
            got = compiled(*inputs)
            torch.cuda.synchronize()
            row[f"{label}_compile_s"] = time.perf_counter() - start
            row[f"{label}_rel_err"] = max_error(got, want)
        times = {label: [] for label in runs}
        for _ in range(rounds):
            for label, fn in runs.items():
                times[label].append(timed(fn, inputs))
        for label, ms in times.items():
            row[f"{label}_ms"] = statistics.median(ms)
            row[f"{label}_rounds_ms"] = ms
        for label, fn in runs.items() if host else ():
            row.update({f"{label}_{key}": value for key, value in host_timing(fn, inputs).items()})
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=DEFAULT_CASES, choices=list(CASES))
    parser.add_argument("--dtype", nargs="+", default=["float32", "float16"])
    parser.add_argument("--json", help="write the rows to this file")
    parser.add_argument("--rounds", type=int, default=1, help="time every backend this many times, in turn "
                        "(medians reported)")
    parser.add_argument("--tf32", action="store_true", help="allow TF32 in float32 matmuls and convolutions")
    parser.add_argument("--host", action="store_true", help="also the host's microseconds per call and the time "
                        "per call of calls issued back to back (see host_timing)")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = args.tf32
    torch.backends.cudnn.allow_tf32 = args.tf32
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, TF32 {'on' if args.tf32 else 'off'}")
    head = (f"{'model':<9} {'dtype':<8} {'eager ms':>9} {'inductor ms':>12} {'ind. graphs ms':>15} "
            f"{'kiln ms':>8} {'vs eager':>9} {'vs inductor':>12} {'vs ind. graphs':>15} "
            f"{'kiln compile s':>15} {'kiln rel err':>13}")
    print(head)
    rows = []
    for name in args.models:
        for dt in args.dtype:
            try:
                r = run_case(name, getattr(torch, dt), args.rounds, args.host)
            except Exception as exc:  # report the failure in the table and go on
                print(f"{name:<9} {dt:<8} FAILED: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                rows.append({"model": name, "dtype": dt, "error": f"{type(exc).__name__}: {exc}"})
                continue
            rows.append(r)
            print(f"{name:<9} {r['dtype']:<8} {r['eager_ms']:>9.3f} {r['inductor_ms']:>12.3f} "
                  f"{r['inductor_cg_ms']:>15.3f} {r['kiln_ms']:>8.3f} "
                  f"{r['eager_ms'] / r['kiln_ms']:>8.2f}x {r['inductor_ms'] / r['kiln_ms']:>11.2f}x "
                  f"{r['inductor_cg_ms'] / r['kiln_ms']:>14.2f}x {r['kiln_compile_s']:>15.1f} "
                  f"{r['kiln_rel_err']:>13.1e}", flush=True)
            if args.host:
                print("    host us / call, loop us / call: " + ", ".join(
                    f"{label} {r[label + '_host_us']:.0f} / {r[label + '_loop_us']:.0f}"
                    for label in ("eager", "inductor", "inductor_cg", "kiln")), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
