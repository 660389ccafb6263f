"""Data-parallel training of a tiny Llama-style model compiled by Kiln, and the one-process run
on the global batch it must reproduce.

`ddp_losses` starts `world` processes (gloo on the CPU, NCCL on GPUs, one GPU a process); each
wraps the model in DDP (buckets of 1 MB, so that dynamo's DDP optimizer splits the graph into
several pieces, each compiled by the backend) or, with `wrap="fsdp2"`, shards it with FSDP2
(`fully_shard` on each decoder layer, the model's first ModuleList, and on the whole; dynamo skips FSDP's hooks, which gather
and free the parameters around each layer in eager), trains on its slice of every global batch
and records the loss averaged over the processes, which is the global batch's mean loss. Rank 0
writes the losses and the median step time to a JSON file.
"""
from __future__ import annotations

import copy
import datetime
import faulthandler
import json
import os
import statistics
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from training_support import LanguageModel

VOCAB, LENGTH = 96, 16
BUCKET_MB = 1   # DDP's (and dynamo's DDP optimizer's) first bucket holds 1 MB: the model's ~1.9 MB make two


def tiny_llama(seed: int = 0) -> LanguageModel:
    import transformers
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=256, max_position_embeddings=LENGTH)
    return LanguageModel(transformers.LlamaForCausalLM(config))


def global_batches(steps: int, batch: int, seed: int = 1, vocab: int = VOCAB,
                   length: int = LENGTH) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`steps` global batches of random tokens, cycling through two, so that the loss falls."""
    generator = torch.Generator().manual_seed(seed)
    two = [(torch.randint(0, vocab, (batch, length), generator=generator),
            torch.randint(0, vocab, (batch, length), generator=generator)) for _ in range(2)]
    return [two[i % 2] for i in range(steps)]


def _optimizer(params):
    # SGD: Adam's first steps divide gradients by their own magnitude, so a gradient element that
    # is zero up to rounding (summed in another order by the all-reduce) moves by a whole lr
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _timed_steps(step, steps: int, device: str) -> tuple[list[float], list[float]]:
    """Run `step(i)` for i < steps; (its losses, its times in ms)."""
    losses, times = [], []
    for i in range(steps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            losses.append(step(i))
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            losses.append(step(i))
    return losses, times


def _loss(run, ids, labels, device: str, autocast: torch.dtype | None):
    with torch.autocast(device, dtype=autocast, enabled=autocast is not None):
        return run(ids, labels)


def single_process_losses(model, batches, device: str, backend: str | None,
                          autocast: torch.dtype | None = None) -> tuple[list[float], list[float]]:
    """Losses (and step times) of training a copy of `model` on the whole batches in one process
    (the forward under autocast to `autocast` when given)."""
    model = copy.deepcopy(model).to(device).train()
    run = model if backend is None else torch.compile(model, backend=backend)
    opt = _optimizer(model.parameters())

    def step(i):
        ids, labels = (t.to(device) for t in batches[i])
        opt.zero_grad()
        loss = _loss(run, ids, labels, device, autocast)
        loss.backward()
        opt.step()
        return loss.item()
    return _timed_steps(step, len(batches), device)


def _wrapped(model, wrap: str, rank: int, device: str, bucket_mb: float):
    """`model` (on its rank's device) wrapped for data parallelism by `wrap` ("ddp" with buckets
    of `bucket_mb`, "fsdp2")."""
    if wrap == "ddp":
        return torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[rank] if device == "cuda" else None, bucket_cap_mb=bucket_mb)
    from torch.distributed.fsdp import fully_shard
    decoder_layers = next(m for m in model.modules() if isinstance(m, torch.nn.ModuleList))
    for layer in decoder_layers:
        fully_shard(layer)
    return fully_shard(model)


# A rank that hangs dumps every thread's stack into its report and exits after this long (below
# pytest-timeout's 20 minutes, which would end the whole test worker and say nothing of the ranks).
RANK_WATCHDOG_S = 900


def _worker(rank: int, world: int, folder: str, device: str, backend: str | None, wrap: str,
            autocast: torch.dtype | None, bucket_mb: float):
    report = open(os.path.join(folder, f"rank{rank}.report"), "w")
    faulthandler.dump_traceback_later(RANK_WATCHDOG_S, exit=True, file=report)
    # a rendezvous file, not a port: a port picked free can be taken by another process before
    # rank 0 binds it; a rank that waits on a collective the others never reach raises after the timeout
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=rank, world_size=world,
                            init_method="file://" + os.path.join(folder, "rendezvous"),
                            timeout=datetime.timedelta(minutes=5))
    try:
        if device == "cuda":
            torch.cuda.set_device(rank)
        else:       # the ranks share the cores: more threads each would only spin against each other
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        where = f"cuda:{rank}" if device == "cuda" else "cpu"
        model, batches = torch.load(os.path.join(folder, "job.pt"), weights_only=False)
        model = model.to(where).train()
        parallel = _wrapped(model, wrap, rank, device, bucket_mb)
        run = parallel if backend is None else torch.compile(parallel, backend=backend)
        opt = _optimizer(parallel.parameters())

        def step(i):
            ids, labels = (t.chunk(world)[rank].to(where) for t in batches[i])
            opt.zero_grad()
            loss = _loss(run, ids, labels, device, autocast)
            loss.backward()
            opt.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            return mean.item() / world
        losses, times = _timed_steps(step, len(batches), device)
        if rank == 0:
            from kiln.frontend.torch.backend import KilnFunction
            with open(os.path.join(folder, "rank0.json"), "w") as f:
                json.dump({"losses": losses, "step_ms": statistics.median(times[3:]) if len(times) > 3 else None,
                           "kiln_graphs": sum(len(g.graphs) for g in KilnFunction.live())}, f)
    except BaseException:
        # leave at once: tearing down a process group whose peers wait in a collective can block
        # until their timeout, and the caller reads the report instead
        traceback.print_exc(file=report)
        report.close()
        os._exit(1)
    faulthandler.cancel_dump_traceback_later()
    dist.destroy_process_group()
    report.close()
    # leave without freeing the rest: DDP's reducer freed after the process group can deadlock in
    # torch's gloo teardown (~ProcessGroupGloo, holding the GIL, waits for gloo's worker thread,
    # which waits for the GIL to free a finished all-reduce's tensors); a CI run hung there
    os._exit(0)


def _reports(folder: str, world: int) -> str:
    texts = []
    for rank in range(world):
        path = os.path.join(folder, f"rank{rank}.report")
        text = open(path).read().strip() if os.path.exists(path) else ""
        texts.append(f"--- rank {rank} ---\n{text or '(nothing reported)'}")
    return "\n".join(texts)


def ddp_losses(model, batches, world: int, device: str, backend: str | None = "kiln", wrap: str = "ddp",
               autocast: torch.dtype | None = None, bucket_mb: float = BUCKET_MB) -> dict:
    """{"losses": the global mean loss of each step, "step_ms": median step time (CUDA),
    "kiln_graphs": the graphs Kiln compiled on rank 0} of data-parallel training (`wrap`: "ddp"
    with buckets of `bucket_mb`, or "fsdp2") over `world` processes; `backend` None runs the
    model eagerly, `autocast` a dtype runs the forward under autocast to it."""
    with tempfile.TemporaryDirectory() as folder:
        # the ranks read the model and batches from a file: passed as arguments, spawn would move
        # the caller's tensors into shared memory and serve them from a thread of this process
        torch.save((model, batches), os.path.join(folder, "job.pt"))
        try:
            mp.spawn(_worker, args=(world, folder, device, backend, wrap, autocast, bucket_mb), nprocs=world)
        except mp.ProcessExitedException as exc:
            raise RuntimeError(f"a rank of data-parallel training failed: {exc}\n{_reports(folder, world)}") from None
        with open(os.path.join(folder, "rank0.json")) as f:
            return json.load(f)
