"""Memory of a training step through Kiln, counted graph by graph (`kiln.frontend.torch.memory`).

GPT-2 (transformers' GPT2LMHeadModel, dropout off, LM head and cross-entropy inside the model)
with few layers, one forward and backward through Kiln, optionally under bfloat16 autocast; on
the CPU by default, so that it runs where no GPU is. For each graph Kiln compiled (the forward,
the backward) it prints the constants it holds, its workspace of intermediates (held as long
as the graph lives), the inputs a run reads and the outputs it allocates, the values the
forward saves for the backward, and the largest constants and saved values with the operator
that makes them. Last, what CUDA graph captures of these graphs hold besides the values
saved and the gradients (`kiln.runtime.cuda_graph`): each graph's workspace with a static buffer
for each input copied in and each output copied out (as before captures shared a workspace),
and the workspaces shared by the captures of the device, which hold those buffers too (one at
the second step on: the largest).

    python benchmarks/train_memory.py [--layers 2] [--batch 2] [--seq 256] [--vocab 50257]
        [--autocast] [--device cpu] [--top 8] [--json out.json]
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import warnings

import torch

MB = 1e6


def gpt2(layers: int, vocab: int, device: str):
    from transformers import GPT2Config, GPT2LMHeadModel
    config = GPT2Config(n_layer=layers, n_embd=768, vocab_size=vocab, use_cache=False,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config).to(device)


def step_memory(model, ids, autocast: bool) -> list[dict]:
    """One forward and backward of `model` through Kiln on `ids` (labels too); the memory of
    each graph compiled, as dicts of `GraphMemory`'s fields."""
    from kiln.frontend.torch import KilnFunction
    from kiln.frontend.torch.memory import graph_memory
    before = set(KilnFunction.live())
    compiled = torch.compile(model, backend="kiln", options={"graph_cache": False})   # graphs traced, not served
    region = (torch.autocast(ids.device.type, dtype=torch.bfloat16) if autocast
              else contextlib.nullcontext())
    with region:
        loss = compiled(input_ids=ids, labels=ids).loss
    loss.backward()
    new = [f for f in KilnFunction.live() if f not in before]
    forwards = {str(f.compile_id): f for f in new if f.lent_from != 0}
    last = max(forwards, default=None)
    rows = []
    for function in new:
        kind = "backward" if function.lent_from == 0 else "forward"
        compile_id = str(function.compile_id)
        bound = None if kind == "forward" else backward_bound(function, forwards.get(compile_id), compile_id != last)
        rows += [dict(dataclasses.asdict(m), graph=kind, compile_id=str(function.compile_id))
                 for m in graph_memory(function, bound)]
    # the order of the first captures: forwards as called, then backwards in reverse
    forward_rows = sorted((r for r in rows if r["graph"] == "forward"), key=lambda r: r["compile_id"])
    backward_rows = sorted((r for r in rows if r["graph"] == "backward"), key=lambda r: r["compile_id"], reverse=True)
    return forward_rows + backward_rows


def backward_bound(backward, forward, lent_gradients: bool) -> set[int]:
    """The positions of a backward's arguments that its captures read in place: the values its
    forward saved (lent by the forward's captures), the forward's parameters (which the forward's
    captures read in place) and, with `lent_gradients`, the incoming gradients (`tangents_*`,
    lent by the backward of the graph that follows), not the other inputs of the forward it
    saved (a batch, logits from another graph)."""
    static = {f"primals_{k + 1}" for k in (forward.static_inputs if forward is not None else ())}
    names = [n.name for n in backward.gm.graph.nodes if n.op == "placeholder"]
    return {k for k, name in enumerate(names)
            if (lent_gradients if name.startswith("tangents") else not name.startswith("primals") or name in static)}


def shared_workspaces(sizes: list[int]) -> list[int]:
    """The shared workspaces that captures of these workspace sizes make at the first step,
    captured in this order: a capture that needs more than the current one starts a larger one
    (from the next step on, the others are captured again on the largest)."""
    made = []
    for size in sizes:
        if not made or size > made[-1]:
            made.append(size)
    return made


def report(rows: list[dict], top: int) -> None:
    for r in rows:
        print(f"{r['graph']}: constants {r['constants'] / MB:.1f} MB, workspace {r['workspace'] / MB:.1f} MB "
              f"(intermediates {r['intermediates'] / MB:.1f} MB), inputs {r['inputs'] / MB:.1f} MB, "
              f"outputs {r['outputs'] / MB:.1f} MB, saved for the backward {r['saved'] / MB:.1f} MB")
        for title, key in (("constant", "largest_constants"), ("saved", "largest_saved"),
                           ("workspace", "largest_intermediates")):
            for v in r[key][:top]:
                print(f"    {title:<9} {v['nbytes'] / MB:9.2f} MB  {v['signature']:<32} {v['made_by']}")
    total = sum(r["constants"] + r["workspace"] for r in rows)
    saved = sum(r["saved"] for r in rows)
    print(f"held by the graphs: {total / MB:.1f} MB; saved between forward and backward: {saved / MB:.1f} MB")
    for r in rows:
        print(f"CUDA graph of the {r['graph']} {r['compile_id']}: workspace {r['workspace'] / MB:.1f} MB, "
              f"copied in {r['copied_in'] / MB:.1f} MB, copied out {r['copied_out'] / MB:.1f} MB; "
              f"all in one workspace {r['captured_workspace'] / MB:.1f} MB")
    own = sum(r["workspace"] + r["copied_in"] + r["copied_out"] for r in rows)
    shared = shared_workspaces([r["captured_workspace"] for r in rows])
    print(f"CUDA graphs hold: {own / MB:.1f} MB with a workspace each and static buffers; in shared "
          f"workspaces {sum(shared) / MB:.1f} MB at the first step ({', '.join(f'{b / MB:.1f}' for b in shared)} MB), "
          f"{max(shared, default=0) / MB:.1f} MB from the second")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--autocast", action="store_true", help="bfloat16 autocast")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--top", type=int, default=8, help="largest constants and saved values to show")
    parser.add_argument("--json", help="write the rows to this file")
    args = parser.parse_args()
    warnings.simplefilter("ignore", FutureWarning)
    torch.manual_seed(0)
    model = gpt2(args.layers, args.vocab, args.device)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=args.device)
    rows = step_memory(model, ids, args.autocast)
    report(rows, args.top)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "graphs": rows}, f, indent=1)


if __name__ == "__main__":
    main()
