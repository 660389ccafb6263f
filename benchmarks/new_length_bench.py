"""What a new sequence length costs: the first call of a compiled GPT-2 at each of several new
lengths, Kiln against Inductor, in one process (issue 33: sizes as run-time arguments, so that a
new length builds no kernel).

GPT-2 small (transformers, random weights, `--dtype` float16 by default) at batch 1 is compiled
at the first length of `--lengths`, then called at each of the others in turn: dynamo traces
again with symbolic sizes at the second length, and each backend compiles what it needs. Reported
per backend and length: the seconds of the first call at that length (synchronized), the
milliseconds of a later call, the largest difference of the logits from eager's, and for Kiln
the kernels it built during that first call (the `kiln` log's kernel cache misses). Run it with empty caches (`KILN_CACHE_DIR` and
`TORCHINDUCTOR_CACHE_DIR` pointing at new folders) to see what a user's first run costs.

Backend `kiln_static` compiles with `dynamic=False`: a plan traced at each length, with kernels
for that length's sizes, the baseline a reused plan's latency is held to. With `--rounds N`, the
later calls are timed again after every backend has seen every length, N rounds alternating
backends, and `call_ms` is the median of the rounds (a same-run A/B).

    python benchmarks/new_length_bench.py [--lengths 128 96 160 200 64 256 320] [--dtype float16]
        [--backends inductor kiln kiln_static] [--device cuda] [--layers 12]
        [--kiln-option plan_ahead=never] [--rounds 5] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
import warnings

import torch


class _Builds(logging.Handler):
    """Counts the kernels the `kiln` log says were built (kernel cache misses)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.count = 0

    def emit(self, record):
        if record.getMessage().startswith("kernel cache miss: building"):
            self.count += 1


def gpt2(dtype, device: str, layers: int):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    config = GPT2Config(n_layer=layers, use_cache=False)
    return config, GPT2LMHeadModel(config).to(device, dtype).eval()


def _synchronize(ids) -> None:
    if ids.is_cuda:
        torch.cuda.synchronize()


def later_ms(fn, ids, calls: int = 10) -> float:
    """Milliseconds of a call of `fn(ids)`, averaged over `calls` after three warm ones."""
    for _ in range(3):
        fn(ids)
    _synchronize(ids)
    start = time.perf_counter()
    for _ in range(calls):
        fn(ids)
    _synchronize(ids)
    return (time.perf_counter() - start) / calls * 1e3


def first_and_later(fn, ids) -> tuple[float, float]:
    """(seconds of the first call, milliseconds of a later one) of `fn(ids)`."""
    _synchronize(ids)
    start = time.perf_counter()
    fn(ids)
    _synchronize(ids)
    return time.perf_counter() - start, later_ms(fn, ids)


def _option(text: str) -> tuple:
    """('name', value) of a NAME=VALUE argument, the value read as JSON where it is JSON."""
    name, _, value = text.partition("=")
    try:
        return name, json.loads(value)
    except json.JSONDecodeError:
        return name, value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", nargs="+", type=int, default=[128, 96, 160, 200, 64, 256, 320])
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--backends", nargs="+", default=["inductor", "kiln"], choices=["inductor", "kiln", "kiln_static"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--kiln-option", action="append", default=[], metavar="NAME=VALUE",
                        help="an option of Kiln's compile (a JSON value, else a string), e.g. plan_ahead=never")
    parser.add_argument("--rounds", type=int, default=0,
                        help="time every backend's later calls again in this many alternating rounds")
    parser.add_argument("--json", help="write the rows to this file")
    args = parser.parse_args()
    kiln_options = dict(_option(text) for text in args.kiln_option)
    warnings.simplefilter("ignore")
    config, model = gpt2(getattr(torch, args.dtype), args.device, args.layers)
    builds = _Builds()
    kiln_log = logging.getLogger("kiln")
    kiln_log.addHandler(builds)
    kiln_log.setLevel(logging.INFO)
    # every backend keeps its entries for every length, so that the rounds alternate without recompiling
    torch._dynamo.config.cache_size_limit = torch._dynamo.config.accumulated_cache_size_limit = 256
    rows = []
    inputs = {length: torch.randint(0, config.vocab_size, (1, length), device=args.device) for length in args.lengths}
    calls = {}
    with torch.no_grad():
        torch._dynamo.reset()
        for backend in args.backends:
            kiln = backend.startswith("kiln")
            compiled = torch.compile(model, backend="kiln" if kiln else backend,
                                     dynamic=False if backend == "kiln_static" else None,
                                     options=kiln_options if kiln else None)
            calls[backend] = lambda x, compiled=compiled: compiled(x).logits
            for length, ids in inputs.items():
                built = builds.count
                first, later = first_and_later(calls[backend], ids)
                # a plan bound to a new length computes what eager does there
                difference = (compiled(ids).logits.float() - model(ids).logits.float()).abs().max().item()
                row = {"backend": backend, "length": length, "first_call_s": first, "call_ms": later,
                       "max_abs_diff_vs_eager": difference}
                if kiln:
                    row["kernels_built"] = builds.count - built
                rows.append(row)
                extra = f"  {row['kernels_built']} kernels built" if "kernels_built" in row else ""
                print(f"{backend:<9} length {length:4d}  first call {first:7.3f} s  later {later:8.3f} ms{extra}"
                      f"  max |diff| vs eager {difference:.2e}", flush=True)
        if args.rounds:
            timings = {(row["backend"], row["length"]): [] for row in rows}
            for _ in range(args.rounds):
                for (backend, length), times in timings.items():
                    times.append(later_ms(calls[backend], inputs[length], calls=50))
            for row in rows:
                row["call_ms_rounds"] = timings[row["backend"], row["length"]]
                row["call_ms"] = statistics.median(row["call_ms_rounds"])
            for length in args.lengths:
                print(f"length {length:4d}  median ms of {args.rounds} rounds: " + "  ".join(
                    f"{backend} {statistics.median(timings[backend, length]):.3f}" for backend in args.backends))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if args.device == "cuda" else args.device,
                       "torch": torch.__version__, "dtype": args.dtype, "layers": args.layers,
                       "kiln_options": kiln_options, "rows": rows},
                      f, indent=1)


if __name__ == "__main__":
    main()
