"""PyTorch's OpInfo samples, through torch.compile(backend="kiln"), for every op with a rule.

The float32 OpInfos are dealt round-robin into SHARDS parametrized tests, so that test workers
share them. For each mapped op the first samples run through the backend with fullgraph=True
and are compared with eager; samples whose features are out of scope are skipped with a reason,
and counted. Each shard must have at least MATCH_RATE of its samples match and at least
CLEAN_OPS_PER_SHARD ops whose every sample matches. Over all shards, at the time of writing:
466 of 677 float32 ops pass every sample (470 mapped), and 2214 of 2221 samples of mapped ops
match (99.7%); the summary lines print with -s (or -rP under xdist). On a GPU the same shards
run on CUDA (`-m cuda`), fewer samples an op, where no sample may give other values than eager's.
"""
import pytest
import torch

from opinfo_samples import float32_ops, run_ops

SHARDS = 4
MATCH_RATE = 0.99
CLEAN_OPS_PER_SHARD = 100
CUDA_SAMPLES = 3


@pytest.mark.slow
@pytest.mark.parametrize("shard", range(SHARDS))
def test_opinfo_samples_match_eager(shard):
    tally = run_ops(float32_ops()[shard::SHARDS])
    print(f"\nshard {shard}: {tally.summary()}")
    print("\n".join(tally.failures))
    assert tally.rate >= MATCH_RATE, "\n".join(tally.failures)
    assert tally.clean >= CLEAN_OPS_PER_SHARD, tally.summary()


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.parametrize("shard", range(SHARDS))
def test_opinfo_samples_match_eager_on_cuda(shard, monkeypatch):
    """The ops of a shard that support float32 on the CPU and on CUDA, their first CUDA_SAMPLES
    samples on CUDA (TF32 off, so that eager's float32 is float32): the CPU's bars, and no sample
    whose values differ from eager's (a sample may still raise, naming what is not supported)."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    cudnn = torch.backends.cudnn     # PyTorch's test modules freeze its flags but for this context
    with cudnn.flags(enabled=cudnn.enabled, benchmark=cudnn.benchmark, deterministic=cudnn.deterministic,
                     allow_tf32=False):
        tally = run_ops(float32_ops("cpu", "cuda")[shard::SHARDS], "cuda", CUDA_SAMPLES)
    print(f"\nshard {shard} on cuda: {tally.summary()}")
    print("\n".join(tally.failures))
    assert not tally.wrong, "\n".join(tally.wrong)
    assert tally.rate >= MATCH_RATE, "\n".join(tally.failures)
    assert tally.clean >= CLEAN_OPS_PER_SHARD, tally.summary()
