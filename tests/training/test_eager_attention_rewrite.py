"""Attention written out in torch operations becomes one scaled_dot_product_attention before
AOTAutograd (kiln-mappings-builtin's `eager_attention` graph rewrite): where it applies (a scale
by a number or none, no mask, a causal mask made from constants, with float16's lowest or
-inf, probabilities cast back, dropout of 0) the rewritten graph computes what the graph did;
where it does not (a mask from an input, a mask that is not causal or too weak, probabilities
read elsewhere, real dropout, a scale by a tensor) the graph is left alone. A Llama with
transformers' eager attention trains through Kiln with eager's gradients, one rewrite a layer."""
import copy

import pytest
import torch
import torch.nn.functional as F

from kiln.frontend.torch import graph_rewrites
from kiln.frontend.torch import training

B, H, L, D = 2, 3, 7, 8


def _causal(fill: float):
    rows = torch.arange(L)
    return torch.where(rows[None, :] <= rows[:, None], 0.0, fill)[None, None]


def _graph(fn, *inputs):
    """The dynamo graph of `fn` and its example inputs."""
    graphs = []

    def backend(gm, examples):
        graphs.append((gm, examples))
        return gm
    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(*inputs)
    [(gm, examples)] = graphs
    return gm, examples


def _qkv():
    return [torch.randn(B, H, L, D) for _ in range(3)]


def _attention(q, k, v, mask=None, scale=0.35, dropout=0.0, cast=True):
    s = torch.matmul(q, k.transpose(-2, -1)) * scale
    if mask is not None:
        s = s + mask
    p = F.softmax(s, dim=-1, dtype=torch.float32)
    if cast:
        p = p.to(q.dtype)
    p = F.dropout(p, p=dropout, training=True)
    return torch.matmul(p, v)


REWRITTEN = {
    "no mask": lambda q, k, v: _attention(q, k, v),
    "divided, no cast": lambda q, k, v: torch.matmul(F.softmax(q @ k.transpose(2, 3) / 3.0, dim=-1), v),
    "unscaled": lambda q, k, v: torch.matmul(torch.softmax(torch.matmul(q, k.transpose(-1, -2)), -1), v),
    "causal, float32 lowest": lambda q, k, v: _attention(q, k, v, _causal(torch.finfo(torch.float32).min)),
    "causal, -inf, mask first": lambda q, k, v: torch.matmul(
        (_causal(float("-inf")) + torch.matmul(q, k.transpose(-2, -1)) * 0.5).softmax(-1), v),
    "causal, float16 lowest": lambda q, k, v: _attention(q, k, v, _causal(torch.finfo(torch.float16).min)),
    "zeros mask": lambda q, k, v: _attention(q, k, v, torch.zeros(1, 1, L, L)),
    "GPT-2's cast": lambda q, k, v: torch.matmul(
        F.softmax(torch.matmul(q, k.transpose(-1, -2)) * 0.25 + _causal(-1e38), dim=-1).type(v.dtype), v),
}


@pytest.mark.parametrize("case", list(REWRITTEN))
def test_rewritten_to_one_attention(case):
    q, k, v = _qkv()
    gm, examples = _graph(REWRITTEN[case], q, k, v)
    expected = gm(*examples)
    assert graph_rewrites.rewrite_graph(gm) == 1
    targets = [n.target for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
    assert targets == [F.scaled_dot_product_attention], targets
    causal = next(n for n in gm.graph.nodes if n.target is F.scaled_dot_product_attention).kwargs["is_causal"]
    assert causal == ("causal" in case or "GPT-2" in case)
    torch.testing.assert_close(gm(*examples), expected, rtol=1e-5, atol=1e-6)


LEFT_ALONE = {
    "mask from an input": lambda q, k, v, m: _attention(q, k, v, m),
    "banded mask": lambda q, k, v, m: _attention(q, k, v, torch.where(
        (torch.arange(L)[None, :] - torch.arange(L)[:, None]).abs() <= 1, 0.0, float("-inf"))),
    "weak mask": lambda q, k, v, m: _attention(q, k, v, _causal(-1000.0)),
    "upper causal": lambda q, k, v, m: _attention(q, k, v, _causal(float("-inf")).transpose(-1, -2)),
    "probabilities returned": lambda q, k, v, m: (lambda p: (torch.matmul(p, v), p))(
        F.softmax(torch.matmul(q, k.transpose(-2, -1)) * 0.5, dim=-1)),
    "dropout": lambda q, k, v, m: _attention(q, k, v, dropout=0.1),
    "scaled by a tensor": lambda q, k, v, m: torch.matmul(
        F.softmax(torch.matmul(q, k.transpose(-2, -1)) / torch.full([], 2.0), dim=-1), v),
    "divided with rounding": lambda q, k, v, m: torch.matmul(
        F.softmax(torch.div(torch.matmul(q, k.transpose(-2, -1)), 2, rounding_mode="floor"), dim=-1), v),
    "softmax over another dim": lambda q, k, v, m: torch.matmul(
        F.softmax(torch.matmul(q, k.transpose(-2, -1)), dim=-2), v),
}


@pytest.mark.parametrize("case", list(LEFT_ALONE))
def test_left_alone(case):
    q, k, v = _qkv()
    mask = torch.randn(1, 1, L, L)
    gm, examples = _graph(LEFT_ALONE[case], q, k, v, mask)
    before = [n.target for n in gm.graph.nodes]
    assert graph_rewrites.rewrite_graph(gm) == 0
    assert [n.target for n in gm.graph.nodes] == before


def _counted_rewrites(monkeypatch) -> list[int]:
    """The number of rewrites of each graph compiled for training from now on."""
    rewrites = []

    def counted(gm):
        rewrites.append(graph_rewrites.rewrite_graph(gm))
        return rewrites[-1]
    monkeypatch.setattr(training, "rewrite_graph", counted)
    return rewrites


def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
                                      attn_implementation="eager", use_cache=False)
    return transformers.LlamaForCausalLM(config)


def test_a_llama_with_eager_attention_trains_with_eagers_gradients(monkeypatch):
    rewrites = _counted_rewrites(monkeypatch)
    model = _tiny_llama()
    reference = copy.deepcopy(model)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="kiln")
    ids = torch.randint(0, 300, (2, 13))
    weights = torch.randn(2, 13, 300)
    for m in (compiled, reference):
        (m(ids).logits * weights).sum().backward()
    assert rewrites == [2]
    for (name, p), r in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_a_llama_under_autocast_is_rewritten_with_casts(monkeypatch):
    """Under bfloat16 autocast the rotary embedding leaves q and k float32 and v bfloat16: the
    attention takes the three cast to bfloat16 (the matmuls' dtype under autocast), and the
    gradients stay within twice autocast eager's error against float64 (plus 1e-2)."""
    rewrites = _counted_rewrites(monkeypatch)
    model = _tiny_llama()
    reference, eager = copy.deepcopy(model).double(), copy.deepcopy(model)
    ids = torch.randint(0, 300, (2, 13))
    weights = torch.randn(2, 13, 300, dtype=torch.float64)
    (reference(ids).logits * weights).sum().backward()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="kiln")
    for m in (compiled, eager):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = m(ids).logits
        (logits.double() * weights).sum().backward()
    assert rewrites == [2]
    error = lambda g, w: ((g.double() - w).norm() / w.norm()).item()
    for (name, p), e, r in zip(model.named_parameters(), eager.parameters(), reference.parameters()):
        assert error(p.grad, r.grad) <= 2 * error(e.grad, r.grad) + 1e-2, name


def test_a_bfloat16_llama_trains_through_the_fused_pair_without_saved_probabilities(monkeypatch):
    """The rewrite's whole path, with the fused pair enabled on the CPU (as the GPU has it by
    default): no [B, H, L, L] value is saved, and the gradients' errors against float64 are at
    most twice eager's bfloat16 errors (plus 1e-2)."""
    transformers = pytest.importorskip("transformers")
    import kiln_mappings_aten.attention as attention
    from kiln.frontend.torch import KilnFunction
    from kiln.frontend.torch.memory import graph_memory
    monkeypatch.setattr(attention, "FUSED_DEVICES", ("cuda", "cpu"))
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
                                      attn_implementation="eager", use_cache=False)
    reference = transformers.LlamaForCausalLM(config).double()
    length = 19
    ids = torch.randint(0, 300, (2, length))
    weights = torch.randn(2, length, 300, dtype=torch.float64)

    def train(model, dtype):
        (model(ids).logits.to(torch.float64) * weights).sum().backward()
        return [p.grad for p in model.parameters()]
    model = copy.deepcopy(reference).to(torch.bfloat16)
    eager = train(copy.deepcopy(model), torch.bfloat16)
    want = train(reference, torch.float64)
    torch._dynamo.reset()
    before = set(KilnFunction.live())
    got = train(torch.compile(model, backend="kiln", options={"graph_cache": False}), torch.bfloat16)
    saved = [v.signature for f in KilnFunction.live() if f not in before and f.lent_from
             for m in graph_memory(f) for v in m.largest_saved]
    assert saved and not [s for s in saved if f"{length}, {length}]" in s], saved
    error = lambda g, w: ((g.double() - w).norm() / w.norm()).item()
    for (name, _), g, e, w in zip(reference.named_parameters(), got, eager, want):
        assert error(g, w) <= 2 * error(e, w) + 1e-2, name
