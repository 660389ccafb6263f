"""Symbolic shapes through torch.compile on a GPU (`cuda` marker): tests/frontend/test_symbolic_shapes.py's
models on CUDA, kernel builds counted from the `kiln` log in a fresh cache. The CUDA templates
take their sizes as arguments but choose their knobs by power-of-two bucket of a symbolic size
(`kiln_ops_builtin.templates.split_k.bucket`), so a sequence that crosses a power of two may build
once more at that step, never at every step."""
import warnings

import pytest
import torch
import transformers
from torch import nn

from tests.frontend.frontend_support import builds_per_length, fresh_compiles, greedy_decode, kernels_built

pytestmark = pytest.mark.cuda


@pytest.fixture(autouse=True)
def fresh(tmp_path, monkeypatch):
    yield from fresh_compiles(tmp_path, monkeypatch)


@pytest.fixture
def built(caplog):
    """The CUDA kernels built so far."""
    return kernels_built(caplog, "cuda")


@pytest.fixture
def builds(built):
    """The number of CUDA kernels built so far."""
    return lambda: len(built())


def _gpt2(n_layer=2, n_positions=64):
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_embd=64, n_layer=n_layer, n_head=2,
                                     n_positions=n_positions, bos_token_id=0, eos_token_id=0)
    return config, transformers.GPT2LMHeadModel(config).eval().cuda()


def test_gpt2_at_five_sequence_lengths_of_one_bucket_builds_once(builds, built):
    _, model = _gpt2(n_layer=1)
    new = builds_per_length(model, (17, 20, 23, 29, 31), builds, "cuda")    # one bucket of 2 x length rows
    assert new[0] > 0 and new[1:] == [0, 0, 0, 0], (new, built()[new[0]:])


def test_decoding_32_tokens_builds_at_bucket_boundaries_only(builds):
    """Greedy tokens over DynamicCache, keys growing from 6 to 37: after the first symbolic
    step, builds happen at most at the steps whose key count crosses 8, 16 and 32."""
    config, model = _gpt2()
    prompt = torch.randint(0, 64, (1, 5), device="cuda")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want, _ = greedy_decode(model, prompt, config, builds)
        got, new = greedy_decode(torch.compile(model, backend="kiln"), prompt, config, builds)
    assert got == want
    assert new[1] > 0 and sum(n > 0 for n in new[2:]) <= 3, new


def test_dynamic_true_cnn_builds_once_for_three_batch_sizes(builds):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Conv2d(16, 32, 3, stride=2), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(32, 5)).eval().cuda().half()
    model[1].running_mean.uniform_(-1, 1)
    compiled = torch.compile(model, backend="kiln", dynamic=True)
    new = []
    for batch in (5, 7, 6):                    # one bucket of batches
        x = torch.randn(batch, 8, 17, 19, device="cuda", dtype=torch.float16)
        before = builds()
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), model(x), atol=2e-2, rtol=2e-2)
        new.append(builds() - before)
    assert new[0] > 0 and new[1:] == [0, 0], new
