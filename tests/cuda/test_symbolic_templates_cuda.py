"""CUDA templates with symbolic sizes on a GPU (`cuda` marker): the contraction and attention
graphs of `symbolic_cases` against PyTorch at odd sizes and 1 (whichever schedule takes each
size); a GPT-2-like model under torch.compile(dynamic=True) at five sequence lengths, and a
decode loop whose KV cache grows a key a step, building kernels at their first call only; a
tuning winner serving the sizes of its bucket."""
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from kiln.settings import Settings

from tests.cuda.symbolic_cases import CASES

TOLERANCE = {"atol": 3e-2, "rtol": 3e-2}


@pytest.mark.cuda
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_symbolic_templates_match_pytorch(case):
    for n in (1,) + case.shared:
        graph = case.graph(n)
        inputs = case.inputs(n)
        for got, want in zip(graph.run(list(inputs)), case.reference(*inputs)):
            torch.testing.assert_close(got.torch().float(), want, **TOLERANCE, msg=lambda m: f"s0 = {n}: {m}")


class Block(nn.Module):
    """A pre-norm GPT-2 block: fused qkv, causal attention over [B, H, L, D] views, an MLP;
    with `cache`, one step of decoding against the keys and values of the steps before."""

    def __init__(self, d: int = 128, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x, past_k=None, past_v=None):
        B, L, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(D, dim=2)
        heads = lambda t: t.view(B, L, self.heads, D // self.heads).transpose(1, 2)
        q, k, v = heads(q), heads(k), heads(v)
        if past_k is not None:
            k, v = torch.cat([past_k, k], 2), torch.cat([past_v, v], 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=past_k is None)
        x = x + self.proj(a.transpose(1, 2).reshape(B, L, D))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh")), k, v


class GPT(nn.Module):
    def __init__(self, vocab: int = 512, d: int = 128, layers: int = 2):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(512, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)[0]
        return self.head(self.ln(x))


@pytest.fixture
def builds(tmp_path, monkeypatch, caplog):
    """The number of kernels built so far (log records "kernel cache miss" on logger "kiln"),
    in an empty kernel cache; dynamo reset before and after, the random seed fixed."""
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    caplog.set_level(logging.INFO, logger="kiln")
    torch._dynamo.reset()
    torch.manual_seed(0)
    yield lambda: sum(r.getMessage().startswith("kernel cache miss") for r in caplog.records)
    torch._dynamo.reset()


def _built_per_call(builds, calls) -> list[int]:
    """The kernels each of `calls` (functions run in turn) built."""
    built = []
    for call in calls:
        before = builds()
        call()
        built.append(builds() - before)
    return built


@pytest.mark.cuda
def test_gpt2_at_five_sequence_lengths_builds_kernels_at_the_first_only(builds):
    model = GPT().cuda().half().eval()
    compiled = torch.compile(model, backend="kiln", dynamic=True)

    def run(length):
        idx = torch.randint(0, 512, (2, length), device="cuda")
        with torch.no_grad():
            torch.testing.assert_close(compiled(idx).float(), model(idx).float(), **TOLERANCE)

    built = _built_per_call(builds, [lambda n=n: run(n) for n in (9, 13, 21, 27, 33)])
    assert built[0] > 0 and built[1:] == [0, 0, 0, 0], built


@pytest.mark.cuda
def test_decoding_with_a_growing_kv_cache_builds_kernels_at_the_first_step_only(builds):
    """300 keys and more: the split-KV decode template, its length a kernel argument."""
    block = Block().cuda().half().eval()
    step = torch.compile(block, backend="kiln", dynamic=True)
    cache = [torch.randn(2, 2, 300, 64, device="cuda", dtype=torch.half) for _ in range(2)]

    def run():
        x = torch.randn(2, 1, 128, device="cuda", dtype=torch.half)
        with torch.no_grad():
            got, want = step(x, *cache), block(x, *cache)
        for g, w in zip(got, want):
            torch.testing.assert_close(g.float(), w.float(), **TOLERANCE)
        cache[:] = want[1:]

    built = _built_per_call(builds, [run] * 6)
    assert built[0] > 0 and built[1:] == [0] * 5, built


@pytest.mark.cuda
def test_a_tuning_winner_serves_the_sizes_of_its_bucket(builds, caplog):
    """Tuned at level 1 for s0 = 9 (M = 18), the linear takes the same winner at s0 = 13 (M = 26,
    the same power-of-two bucket): no timing, no build."""
    case = next(c for c in CASES if c.name == "linear_bias_gelu")

    def run(n):
        graph = case.graph(n)
        graph.compile(Settings(search_space=1))
        inputs = case.inputs(n)
        for got, want in zip(graph.run(list(inputs)), case.reference(*inputs)):
            torch.testing.assert_close(got.torch().float(), want, **TOLERANCE)

    built = _built_per_call(builds, [lambda: run(9), lambda: run(13)])
    tuned = [r for r in caplog.records if r.getMessage().startswith("tuned gemm_sm90")]
    assert built[0] > 0 and built[1] == 0 and len(tuned) == 1, (built, len(tuned))
