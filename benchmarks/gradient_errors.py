"""Each parameter's gradient after one training step, against float64 (issue 32's loss bar): eager
PyTorch, torch.compile's default backend and Kiln under bfloat16 autocast, from the same weights
and batch, next to a float64 eager step. Where the losses of `train_bench.py --fp32-reference`
put one backend further from float32 than another, this says which gradients do.

GPT-2 small at batch 8 x 512 tokens as train_bench's gpt2_b8 (dropout off, TF32 off). For each
kind of parameter (c_attn.weight, ln_1.bias, ..., summed over the layers) it prints the relative
error ||g - g64|| / ||g64|| of each backend, and the loss's relative error.

    python benchmarks/gradient_errors.py [--seeds 0 1 2] [--layers 12] [--json out.json]
"""
from __future__ import annotations

import argparse
import collections
import copy
import json
import re
import warnings

import torch

BACKENDS = {"eager": None, "inductor": {}, "kiln": {"backend": "kiln"}}


def gpt2(layers: int):
    from transformers import GPT2Config, GPT2LMHeadModel
    return GPT2LMHeadModel(GPT2Config(n_layer=layers, use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0)).cuda()


def step(model, ids, autocast: bool) -> tuple[float, dict]:
    """The loss and each parameter's gradient (float64) of one forward and backward."""
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {re.sub(r"^_orig_mod\.", "", name): p.grad.double() for name, p in model.named_parameters()}
    return loss.item(), grads


def kind(name: str) -> str:
    """A parameter's name without its layer: transformer.h.3.attn.c_attn.weight -> attn.c_attn.weight."""
    return re.sub(r"^transformer\.(h\.\d+\.)?", "", name)


def errors(grads: dict, reference: dict) -> dict:
    """Relative error of the gradients of each kind of parameter, its layers taken together."""
    diff, norm = collections.Counter(), collections.Counter()
    for name, want in reference.items():
        diff[kind(name)] += (grads[name] - want).norm().item() ** 2
        norm[kind(name)] += want.norm().item() ** 2
    return {k: (diff[k] / norm[k]) ** 0.5 for k in norm}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=list(BACKENDS))
    parser.add_argument("--json", help="write the rows to this file")
    args = parser.parse_args()
    warnings.simplefilter("ignore", FutureWarning)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    rows = []
    for seed in args.seeds:
        torch.manual_seed(seed)
        model = gpt2(args.layers)
        ids = torch.randint(0, 50257, (8, 512), device="cuda")
        loss64, grads64 = step(copy.deepcopy(model).double(), ids, autocast=False)
        row = {"seed": seed, "loss64": loss64}
        for label in args.backends:
            torch._dynamo.reset()
            run = copy.deepcopy(model)
            compiled = run if BACKENDS[label] is None else torch.compile(run, **BACKENDS[label])
            loss, grads = step(compiled, ids, autocast=True)
            row[label] = {"loss": abs(loss - loss64) / abs(loss64), "grads": errors(grads, grads64)}
            del run, compiled, grads
        rows.append(row)
        labels = [label for label in args.backends if label in row]
        print(f"\nseed {seed}: relative errors against float64 (loss {loss64:.5f})")
        print(f"{'':<24}" + "".join(f"{label:>12}" for label in labels))
        print(f"{'loss':<24}" + "".join(f"{row[label]['loss']:12.2e}" for label in labels))
        for name in row[labels[0]]["grads"]:
            print(f"{name:<24}" + "".join(f"{row[label]['grads'][name]:12.2e}" for label in labels), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
