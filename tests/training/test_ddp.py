"""Data parallelism around a model compiled with backend="kiln", whose losses equal one process
training on the global batch: DistributedDataParallel (dynamo's DDP optimizer splits the graph
at bucket boundaries, each piece goes through Kiln: AOTAutograd, forward and backward) and FSDP2
(`fully_shard` per decoder layer; dynamo skips FSDP's hooks, which gather and free each layer's
parameters in eager, and Kiln compiles the layers' forward and backward)."""
import pytest
import torch
import torch.distributed as dist

from ddp_support import ddp_losses, global_batches, single_process_losses, tiny_llama

pytest.importorskip("transformers")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built")]


def _check(device: str, world: int, steps: int, wrap: str = "ddp"):
    model, batches = tiny_llama(), global_batches(steps, batch=2 * world)
    reference, _ = single_process_losses(model, batches, device, backend=None)
    result = ddp_losses(model, batches, world, device, wrap=wrap)
    got = result["losses"]
    assert result["kiln_graphs"] > 0, "Kiln compiled nothing"
    assert len(got) == steps
    assert got[-1] < got[0], f"training must make progress: {got}"
    torch.testing.assert_close(torch.tensor(got), torch.tensor(reference), rtol=1e-3, atol=0)


def test_ddp_on_two_cpu_processes_matches_one_process_on_the_global_batch():
    _check("cpu", world=2, steps=5)


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_ddp_on_two_gpus_matches_one_gpu_on_the_global_batch():
    _check("cuda", world=2, steps=20)


def test_fsdp2_on_two_cpu_processes_matches_one_process_on_the_global_batch():
    _check("cpu", world=2, steps=4, wrap="fsdp2")


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_fsdp2_on_two_gpus_matches_one_gpu_on_the_global_batch():
    _check("cuda", world=2, steps=20, wrap="fsdp2")
