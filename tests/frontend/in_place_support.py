"""What the CPU and CUDA tests of in-place input updates (issue 31, `kiln.passes.in_place`)
share: the decode-step functions, a tiny Llama over transformers' StaticCache, and the
inspection of a compiled run (its StoreRows steps, the bytes a call writes)."""
from __future__ import annotations

import gc
import warnings

import torch

from kiln.frontend.torch.backend import CompiledRun, KilnFunction
from kiln.graph.in_place import ROWS, is_store, stored_into
from kiln.ir.row_stores import row_stores


def runs() -> list[CompiledRun]:
    """Every compiled run of the live KilnFunctions."""
    gc.collect()
    return [run for f in KilnFunction.live() for run in f.graphs.values()]


def new_runs(before: set[int]) -> list[CompiledRun]:
    return [r for r in runs() if id(r) not in before]


def stores(run: CompiledRun) -> list:
    """The tensors the run's FlowGraph stores new rows into (one per in-place update): those of
    its StoreRows nodes (a node stores several where updates follow each other) and those its
    kernels store the rows they compute into (`kiln.ir.row_stores`)."""
    return [n.outputs[k] for n in store_nodes(run) for k in stored_rows(n)]


def stored_rows(node) -> dict[int, int]:
    """The outputs of `node` that it stores rows into, each with the position of the output
    holding those rows (a StoreRows node's rows are its inputs: -1)."""
    if is_store(node):
        return dict.fromkeys(range(len(node.outputs)), -1)
    return {s.output: s.rows for s in row_stores(node.task)}


def row_nodes(run: CompiledRun) -> list:
    """The UpdateRows nodes and groups of the run's FlowGraph (one kernel each)."""
    return [n for n in run.graph.nodes if n.definition is ROWS]


def store_nodes(run: CompiledRun) -> list:
    """The nodes of the run's FlowGraph that store rows into inputs (one launch each): its
    StoreRows nodes and the kernels that store the rows they compute."""
    return [n for n in run.graph.nodes if stored_rows(n)]


def element_updates(nodes) -> list:
    """The nodes among `nodes` writing element-wise updates of whole inputs into their memory
    (`kiln.passes.in_place_elements`): stored into inputs, but storing no rows."""
    return [n for n in nodes if stored_into(n) and not stored_rows(n)]


def store_launches(run: CompiledRun) -> list:
    """The StoreRows nodes of the run's FlowGraph: launches of their own, after the rows'."""
    return [n for n in run.graph.nodes if is_store(n)]


def in_place_outputs(run: CompiledRun) -> list[int]:
    """The positions of the written-back outputs whose buffer is the input's own."""
    compiled = run.compiled
    first = len(compiled.outputs) - len(run.writeback)
    return [k for k in range(first, len(compiled.outputs)) if compiled.outputs[k] in compiled.inputs]


def bytes_written(run: CompiledRun) -> int:
    """Bytes the steps of one call write: every step's outputs, and for a store of rows into an
    input, the rows it stores (a StoreRows node's rows input, or a kernel's rows output); an
    element-wise update of a whole input counts the input; write-back copies of outputs that are
    not the input's own buffer count their bytes too."""
    compiled = run.compiled
    total = 0
    inputs = set(compiled.inputs)
    assert len(run.graph.nodes) == len(compiled.steps)
    for node, step in zip(run.graph.nodes, compiled.steps):
        rows = stored_rows(node)
        for k, slot in enumerate(step.outputs):
            if k not in rows:
                total += compiled.buffers[slot].nbytes
            elif rows[k] < 0:
                total += compiled.buffers[step.inputs[len(step.outputs) + k]].nbytes
            else:
                total += compiled.buffers[step.outputs[rows[k]]].nbytes
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


def decode(model, config, step, prompt, steps: int, dtype=torch.float32, device="cpu", cache_len: int = 32,
           follow: list | None = None):
    """(logits of each step, the StaticCache after them): `prompt` run by the model, then
    `steps` greedy steps by `step`. With `follow` (the logits of another decode), each step is
    fed the token that decode chose, not its own: in 16 bits two logits a rounding apart can
    make the two runs choose differently, and the steps after that are not comparable."""
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
            token = (follow[i] if follow else logits)[:, -1:].argmax(-1).to(device)
    return out, cache
