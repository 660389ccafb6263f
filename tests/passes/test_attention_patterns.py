"""Attention written out by hand (BERT, GPT-2, ViT, Hugging Face eager attention) becomes the
attention operator, and the rewritten graph gives the values of the original."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kiln
from tests.frontend.frontend_support import compile_and_compare
from tests.passes.passes_support import names, run_both

ops = kiln.ops
transformers = pytest.importorskip("transformers")


def _compiled_names(capture) -> list[str]:
    return [n.name for c in capture.compiled for g in c.graphs.values() for n in g.graph.nodes]


def _uses_attention(capture) -> bool:
    return any(name.endswith("Attention") for name in _compiled_names(capture))


class HandWritten(nn.Module):
    """Multi-head self-attention written out as BERT, GPT-2 and ViT write it."""

    def __init__(self, style, dim=32, heads=4):
        super().__init__()
        self.style, self.heads = style, heads
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.dropout = nn.Dropout(0.1)
        self.register_buffer("causal", torch.tril(torch.ones(16, 16, dtype=torch.bool)).view(1, 1, 16, 16))

    def forward(self, x, additive_mask=None):
        b, n, c = x.shape
        q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2) for t in self.qkv(x).split(c, dim=-1))
        d = q.shape[-1]
        if self.style == "bert":        # scores / sqrt(d) + mask, softmax, dropout, matmul
            scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(d) + additive_mask
        elif self.style == "gpt2_where":  # where with a causal bool mask and finfo.min
            scores = torch.matmul(q, k.transpose(-1, -2)) / torch.full([], d ** 0.5)
            scores = torch.where(self.causal[:, :, :n, :n], scores, torch.finfo(scores.dtype).min)
        elif self.style == "masked_fill":  # masked_fill of the dropped positions with -inf
            scores = (q @ k.transpose(-2, -1)) * d ** -0.5
            scores = scores.masked_fill(~self.causal[:, :, :n, :n], float("-inf"))
        else:                           # ViT: q @ k^T * scale, no mask
            scores = (q @ k.transpose(-2, -1)) * d ** -0.5
        probs = self.dropout(scores.softmax(dim=-1))
        return self.proj((probs @ v).transpose(1, 2).reshape(b, n, c))


@pytest.mark.parametrize("style", ["bert", "gpt2_where", "masked_fill", "vit"])
def test_hand_written_attention_becomes_the_operator(style):
    torch.manual_seed(0)
    model = HandWritten(style).eval()
    x = torch.randn(2, 7, 32)
    inputs = (x,)
    if style == "bert":
        keep = torch.ones(2, 7)
        keep[1, 4:] = 0
        inputs = (x, (1.0 - keep[:, None, None, :]) * torch.finfo(torch.float32).min)
    capture, _ = compile_and_compare(model, *inputs, atol=1e-5, rtol=1e-4)
    assert _uses_attention(capture), _compiled_names(capture)
    assert "Softmax" not in _compiled_names(capture)


def test_a_fill_scores_do_not_absorb_is_left_alone():
    """where(keep, scores, -1e4) differs from a keep-mask on fully masked rows: no rewrite."""
    q, k, v = kiln.symbol([2, 3, 4]), kiln.symbol([2, 5, 4]), kiln.symbol([2, 5, 6])
    keep = kiln.from_torch(torch.rand(2, 3, 5) > 0.5)
    scores = ops.where(keep, ops.mul(ops.matmul(q, ops.transpose(k, -2, -1)), 0.5), -1e4)
    graph = kiln.trace_from(ops.matmul(ops.softmax(scores, -1), v), [q, k, v])
    with kiln.PassContext(disabled_passes=["fuse_operators"]):
        opt = kiln.graph.optimize(graph)
    assert "Attention" not in names(opt)
    run_both(graph, opt, torch.randn(2, 3, 4), torch.randn(2, 5, 4), torch.randn(2, 5, 6))


def test_a_mask_widening_the_scores_is_left_alone():
    q, k, v = kiln.symbol([1, 3, 4]), kiln.symbol([1, 5, 4]), kiln.symbol([1, 5, 6])
    mask = kiln.from_torch(torch.randn(2, 3, 5))
    scores = ops.add(ops.mul(ops.matmul(q, ops.transpose(k, -2, -1)), 0.5), mask)
    graph = kiln.trace_from(ops.matmul(ops.softmax(scores, -1), v), [q, k, v])
    with kiln.PassContext(disabled_passes=["fuse_operators"]):
        opt = kiln.graph.optimize(graph)
    assert "Attention" not in names(opt)
    run_both(graph, opt, torch.randn(1, 3, 4), torch.randn(1, 5, 4), torch.randn(1, 5, 6))


def test_key_transposed_through_a_composed_permute():
    """k^T written as permute(x, (0, 2, 3, 1)) of heads split from a linear."""
    x, v = kiln.symbol([2, 6, 8]), kiln.symbol([2, 2, 6, 4])
    heads = ops.reshape(x, [2, 6, 2, 4])
    q = ops.transpose(heads, 1, 2)
    scores = ops.mul(ops.matmul(q, ops.permute(heads, [0, 2, 3, 1])), 0.5)
    graph = kiln.trace_from(ops.matmul(ops.softmax(scores, -1), v), [x, v])
    with kiln.PassContext(disabled_passes=["fuse_operators"]):
        opt = kiln.graph.optimize(graph)
    assert "Attention" in names(opt) and "Softmax" not in names(opt)
    run_both(graph, opt, torch.randn(2, 6, 8), torch.randn(2, 2, 6, 4))


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_tiny_bert(impl):
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=16, attn_implementation=impl)
    model = transformers.BertModel(config).eval()
    ids = torch.randint(0, 64, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 5:] = 0
    capture, _ = compile_and_compare(model, input_ids=ids, attention_mask=mask)
    assert sum(name.endswith("Attention") for name in _compiled_names(capture)) == 2
    assert "Softmax" not in _compiled_names(capture)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_tiny_gpt2(impl):
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=16,
                                     bos_token_id=0, eos_token_id=0, attn_implementation=impl)
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 64, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[0, :2] = 0
    capture, _ = compile_and_compare(model, input_ids=ids, attention_mask=mask, use_cache=False)
    assert sum(name.endswith("Attention") for name in _compiled_names(capture)) == 2
    assert "Softmax" not in _compiled_names(capture)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sdpa_with_padding_mask_in_16_bit(dtype):
    q, k, v = (torch.randn(2, 4, 9, 16, dtype=dtype) for _ in range(3))
    keep = torch.ones(2, 1, 1, 9, dtype=torch.bool)
    keep[1, ..., 6:] = False
    capture, _ = compile_and_compare(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=keep),
                                     q, k, v, atol=2e-2, rtol=2e-2)
    assert _uses_attention(capture)


def test_a_bool_mask_added_to_the_scores_is_added_not_a_keep_mask():
    q, k, v = kiln.symbol([2, 3, 4]), kiln.symbol([2, 5, 4]), kiln.symbol([2, 5, 6])
    keep = kiln.from_torch(torch.rand(2, 3, 5) > 0.5)
    scores = ops.add(ops.mul(ops.matmul(q, ops.transpose(k, -2, -1)), 0.5), keep)
    graph = kiln.trace_from(ops.matmul(ops.softmax(scores, -1), v), [q, k, v])
    with kiln.PassContext(disabled_passes=["fuse_operators"]):
        opt = kiln.graph.optimize(graph)
    assert "Attention" not in names(opt)
    run_both(graph, opt, torch.randn(2, 3, 4), torch.randn(2, 5, 4), torch.randn(2, 5, 6))


class GroupedQuery(nn.Module):
    """Hugging Face's eager grouped-query attention (Llama, Mistral, Qwen2): keys and values
    repeated per query head (`repeat_kv`), a float32 softmax cast back, a constant mask."""

    def __init__(self, mask_kind, heads=4, kv_heads=2, length=9):
        super().__init__()
        self.heads, self.kv_heads = heads, kv_heads
        keep = torch.ones(length, length, dtype=torch.bool).tril()
        if mask_kind == "padding":           # not causal: one key dropped for every query
            keep = torch.ones(length, length, dtype=torch.bool)
            keep[:, 2] = False
        self.register_buffer("mask", torch.zeros(1, 1, length, length).masked_fill(~keep, torch.finfo(torch.float32).min))

    @staticmethod
    def repeat_kv(x, n):
        b, h, s, d = x.shape
        return x[:, :, None, :, :].expand(b, h, n, s, d).reshape(b, h * n, s, d)

    def forward(self, q, k, v):
        n = self.heads // self.kv_heads
        k, v = self.repeat_kv(k, n), self.repeat_kv(v, n)
        scores = torch.matmul(q, k.transpose(2, 3)) * q.shape[-1] ** -0.5 + self.mask[:, :, :, : k.shape[-2]].to(q.dtype)
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(probs, v).transpose(1, 2).contiguous()


@pytest.mark.parametrize("mask_kind", ["causal", "padding"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_query_attention_with_a_float32_softmax(mask_kind, dtype):
    """One attention operator on the unrepeated keys and values; a causal constant mask
    becomes is_causal (the mask is not read), another stays a mask."""
    torch.manual_seed(0)
    q = torch.randn(2, 4, 9, 16, dtype=dtype)
    k, v = torch.randn(2, 2, 9, 16, dtype=dtype), torch.randn(2, 2, 9, 16, dtype=dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    capture, _ = compile_and_compare(GroupedQuery(mask_kind).eval(), q, k, v, atol=tol, rtol=tol)
    (fused,) = [n for c in capture.compiled for g in c.graphs.values() for n in g.graph.nodes
                if n.name.endswith("Attention")]
    assert "Softmax" not in _compiled_names(capture) and "Expand" not in _compiled_names(capture)
    attention = fused.fused_graph.nodes[fused.attrs["anchor"]]
    assert [t.shape for t in attention.inputs[:3]] == [(2, 4, 9, 16), (2, 2, 9, 16), (2, 2, 9, 16)]
    assert attention.attrs.get("is_causal", False) == (mask_kind == "causal")
    assert len(attention.inputs) == (3 if mask_kind == "causal" else 4)
