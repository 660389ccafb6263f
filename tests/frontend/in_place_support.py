"""What the CPU and CUDA tests of in-place input updates (issue 31, `kiln.passes.in_place`)
share: the decode-step functions, a tiny Llama over transformers' StaticCache, and the
inspection of a compiled run (its StoreRows steps, the bytes a call writes)."""
from __future__ import annotations

import gc
import warnings

import torch

from kiln.frontend.torch.backend import CompiledRun, KilnFunction
from kiln.graph.in_place import ROWS, is_store


def runs() -> list[CompiledRun]:
    """Every compiled run of the live KilnFunctions."""
    gc.collect()
    return [run for f in KilnFunction.live() for run in f.graphs.values()]


def new_runs(before: set[int]) -> list[CompiledRun]:
    return [r for r in runs() if id(r) not in before]


def stores(run: CompiledRun) -> list:
    """The tensors the StoreRows nodes of the run's FlowGraph store into (one per in-place
    update; a node stores several where updates follow each other)."""
    return [t for n in store_nodes(run) for t in n.outputs]


def row_nodes(run: CompiledRun) -> list:
    """The UpdateRows nodes and groups of the run's FlowGraph (one kernel each)."""
    return [n for n in run.graph.nodes if n.definition is ROWS]


def store_nodes(run: CompiledRun) -> list:
    """The StoreRows nodes of the run's FlowGraph (one launch each)."""
    return [n for n in run.graph.nodes if is_store(n)]


def in_place_outputs(run: CompiledRun) -> list[int]:
    """The positions of the written-back outputs whose buffer is the input's own."""
    compiled = run.compiled
    first = len(compiled.outputs) - len(run.writeback)
    return [k for k in range(first, len(compiled.outputs)) if compiled.outputs[k] in compiled.inputs]


def bytes_written(run: CompiledRun) -> int:
    """Bytes the steps of one call write: every step's outputs, and for a store into an input,
    the rows it stores (its second input); write-back copies of outputs that are not the
    input's own buffer count their bytes too."""
    compiled = run.compiled
    total = 0
    inputs = set(compiled.inputs)
    for step in compiled.steps:
        if step.outputs and step.outputs[0] in inputs:
            total += compiled.buffers[step.inputs[1]].nbytes
        else:
            total += sum(compiled.buffers[s].nbytes for s in step.outputs)
    first = len(compiled.outputs) - len(run.writeback)
    total += sum(compiled.buffers[s].nbytes for s in compiled.outputs[first:] if s not in inputs)
    return total


def cache_step(cache: torch.Tensor, new: torch.Tensor, position: torch.Tensor, w: torch.Tensor):
    """A decoding step's cache traffic: new rows written at `position` along dim 1, then the
    whole cache read (an attention-like weighted sum)."""
    cache.index_copy_(1, position, new)
    scores = torch.softmax(cache @ w, dim=-1)
    return (scores.unsqueeze(1) @ cache).squeeze(1)


def two_cache_step(k: torch.Tensor, v: torch.Tensor, new_k, new_v, position, q):
    """Keys and values written at `position` (dim 2, as StaticCache does), then attended to."""
    k.index_copy_(2, position, new_k)
    v.index_copy_(2, position, new_v)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v)


def tiny_llama(layers: int = 2, dtype=torch.float32, device="cpu"):
    import transformers
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
                                      max_position_embeddings=64)
    return config, transformers.LlamaForCausalLM(config).to(device, dtype).eval()


def decode(model, config, step, prompt, steps: int, dtype=torch.float32, device="cpu", cache_len: int = 32):
    """(logits of each step, the StaticCache after them): `prompt` run by the model, then
    `steps` greedy steps by `step`."""
    import transformers
    cache = transformers.StaticCache(config=config, max_batch_size=prompt.shape[0], max_cache_len=cache_len,
                                     dtype=dtype, device=device)
    n = prompt.shape[1]
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        logits = model(prompt, past_key_values=cache, cache_position=torch.arange(n, device=device)).logits
        token, out = logits[:, -1:].argmax(-1), []
        for i in range(steps):
            logits = step(token, past_key_values=cache, cache_position=torch.tensor([n + i], device=device)).logits
            out.append(logits.float().clone())
            token = logits[:, -1:].argmax(-1)
    return out, cache
