"""scaled_dot_product_attention in training graphs: Kiln's decomposition turns it into the
forward that saves each row's log-sum-exp and its backward op (`kiln::attention_forward` /
`kiln::attention_backward`, mapped onto Kiln's `attention_forward` / `attention_backward`)
where they apply, and leaves PyTorch's math form elsewhere. On the CPU the fused pair is enabled
by patching `FUSED_DEVICES`, so that the path is proven here; the GPU runs it by default
(tests/cuda/test_attention_training_cuda.py)."""
import copy
import math

import pytest
import torch
import torch.nn.functional as F

import kiln.frontend.torch.training as training
import kiln_mappings_aten.attention as attention

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


class Block(torch.nn.Module):
    def __init__(self, heads=4, kv_heads=4, dim=32):
        super().__init__()
        self.heads, self.kv_heads, self.dim = heads, kv_heads, dim
        self.q = torch.nn.Linear(heads * dim, heads * dim)
        self.kv = torch.nn.Linear(heads * dim, 2 * kv_heads * dim)
        self.o = torch.nn.Linear(heads * dim, heads * dim)

    def forward(self, x, mask=None, is_causal=True):
        b, n, _ = x.shape
        q = self.q(x).view(b, n, self.heads, self.dim).transpose(1, 2)
        k, v = self.kv(x).view(b, n, 2, self.kv_heads, self.dim).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal and mask is None,
                                           enable_gqa=self.heads != self.kv_heads)
        return self.o(y.transpose(1, 2).reshape(b, n, -1))


def _attention_ops(monkeypatch) -> list:
    """Patch the training path so that it records the attention ops of each compiled ATen graph."""
    seen = []
    compile_for_training = training.compile_for_training

    def spying(gm, examples, compile_aten):
        def compile_half(graph, inputs, *how):
            seen.extend(str(n.target) for n in graph.graph.nodes if "attention" in str(n.target))
            return compile_aten(graph, inputs, *how)
        return compile_for_training(gm, examples, compile_half)

    import kiln.frontend.torch.backend as backend
    monkeypatch.setattr(backend, "compile_for_training", spying)
    return seen


def _train(block, x, **kwargs):
    """Output and gradients (input and parameters) of one backward of a random weighting."""
    x = x.detach().clone().requires_grad_(True)
    y = block(x, **kwargs)
    torch.manual_seed(3)
    (y.float() * torch.randn(y.shape, device=y.device)).sum().backward()
    return [y, x.grad] + [p.grad for p in block.parameters()]


def _relative_errors(got, want):
    return [((g.double() - w.double()).abs().max() / w.double().abs().max()).item() for g, w in zip(got, want)]


def _assert_trains_fused_like_eager(monkeypatch, heads, kv_heads, n, dim, device):
    """A block trained in bfloat16 through Kiln takes the fused pair, and each of its output's and
    gradients' errors against float64 is at most twice eager's bfloat16 error (plus 1e-2)."""
    seen = _attention_ops(monkeypatch)
    torch.manual_seed(0)
    reference = Block(heads, kv_heads, dim).double().to(device)
    x = torch.randn(2, n, heads * dim, dtype=torch.float64, device=device)
    want = _train(reference, x)
    block = copy.deepcopy(reference).to(torch.bfloat16)
    eager = _train(copy.deepcopy(block), x.to(torch.bfloat16))
    got = _train(torch.compile(block, backend="kiln"), x.to(torch.bfloat16))
    assert seen == ["kiln.attention_forward.default", "kiln.attention_backward.default"]
    for g, e in zip(_relative_errors(got, want), _relative_errors(eager, want)):
        assert g <= 2 * e + 1e-2, (g, e)


@pytest.mark.parametrize("heads, kv_heads, n", [(4, 4, 17), (4, 2, 9), (2, 1, 1)])
def test_fused_attention_trains_like_eager(monkeypatch, heads, kv_heads, n):
    monkeypatch.setattr(attention, "FUSED_DEVICES", ("cuda", "cpu"))
    _assert_trains_fused_like_eager(monkeypatch, heads, kv_heads, n, 32, "cpu")


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_masked_attention(monkeypatch, kind):
    """A bool mask trains through the fused pair; a float mask (added to the scores) keeps the
    math form."""
    monkeypatch.setattr(attention, "FUSED_DEVICES", ("cuda", "cpu"))
    seen = _attention_ops(monkeypatch)
    torch.manual_seed(0)
    block = Block().to(torch.bfloat16)
    x = torch.randn(2, 5, 128, dtype=torch.bfloat16)
    keep = torch.rand(2, 1, 5, 5) > 0.3
    keep[0, 0, 3] = False                   # a row with no key: zeros, as PyTorch's math form gives
    mask = keep if kind == "bool" else torch.zeros(keep.shape).masked_fill(keep.logical_not(), -1e4)
    got = _train(torch.compile(copy.deepcopy(block), backend="kiln"), x, mask=mask)
    want = _train(block, x, mask=mask)
    fused = ["kiln.attention_forward.default", "kiln.attention_backward.default"]
    assert seen == (fused if kind == "bool" else [])
    torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)


def test_cpu_keeps_the_math_form_by_default(monkeypatch):
    seen = _attention_ops(monkeypatch)
    block = Block().to(torch.bfloat16)
    _train(torch.compile(block, backend="kiln"), torch.randn(1, 4, 128, dtype=torch.bfloat16))
    assert not any("kiln.attention" in op for op in seen)


def test_torch_operators_match_autograd():
    """The torch operators' own math (what runs where a partition is handed to PyTorch)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, n, 8, requires_grad=True) for n in (5, 7, 7))
    out, lse = torch.ops.kiln.attention_forward(q, k, v, 0.3, True, None)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3)
    torch.testing.assert_close(out, want)
    scores = (q @ k.transpose(-1, -2) * 0.3).masked_fill(torch.ones(5, 7, dtype=torch.bool).triu(1), -math.inf)
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1))
    dout = torch.randn_like(want)
    torch.testing.assert_close(torch.autograd.grad(out, (q, k, v), dout), torch.autograd.grad(want, (q, k, v), dout))


@pytest.mark.cuda
@pytest.mark.parametrize("heads, kv_heads, n", [(12, 12, 128), (8, 2, 77)])
def test_fused_attention_trains_like_eager_on_cuda(monkeypatch, heads, kv_heads, n):
    _assert_trains_fused_like_eager(monkeypatch, heads, kv_heads, n, 64, "cuda")


class PositionMasked(Block):
    """Attention under a mask built in the graph from positions alone, as transformers'
    `create_causal_mask` builds it (a causal comparison and a same-document check through
    `cumsum`, which AOTAutograd's partitioner saves for the backward rather than recompute),
    optionally also dropping the first `hidden` keys."""

    def __init__(self, shift=0, hidden=0):
        super().__init__()
        self.shift, self.hidden = shift, hidden

    def forward(self, x):
        n = x.shape[1]
        pos = torch.arange(n, device=x.device)
        document = torch.cumsum((pos.diff(prepend=pos[:1]) != 1).int(), 0)
        keep = (pos[None, :] <= pos[:, None] + self.shift) & (document[None, :] == document[:, None])
        keep = keep & (pos[None, :] >= self.hidden)
        return super().forward(x, mask=keep.expand(x.shape[0], 1, n, n))


def _attention_nodes(block, x):
    """The attention nodes of the optimized forward and backward graphs Kiln runs for `block`
    in bfloat16, and the relative errors of Kiln's and eager's bfloat16 outputs and gradients
    against float64."""
    from kiln.frontend.torch.backend import KilnFunction
    want = _train(copy.deepcopy(block).double(), x.double())
    block, x = block.to(torch.bfloat16), x.to(torch.bfloat16)
    eager = _train(copy.deepcopy(block), x)
    before = set(KilnFunction.live())
    got = _train(torch.compile(block, backend="kiln"), x)
    graphs = [run.graph for f in KilnFunction.live() if f not in before for run in f.graphs.values()]
    nodes = [n for g in graphs for n in g.nodes if n.definition.name.startswith("attention_")]
    return nodes, _relative_errors(got, want), _relative_errors(eager, want)


@pytest.mark.parametrize("shift, hidden, causal, n", [(0, 0, True, 7), (1000, 0, False, 7), (1, 0, None, 7),
                                                       (0, 2, None, 7), (0, 0, True, 190), (1, 0, None, 190)])
def test_a_constant_causal_mask_becomes_the_causal_flag(monkeypatch, shift, hidden, causal, n):
    """The mask is known in both graphs (the backward recomputes it instead of taking it
    saved): a constant, or at 190 tokens (72,200 bytes, past GENERATED_BYTES_HELD) a generated
    value computed where it is used; one equal to the causal pattern becomes `is_causal` and one
    keeping every key goes (shift 1000), while any other (a shifted diagonal, hidden keys) stays
    a mask. Errors against float64 at most twice eager's bfloat16 errors (plus 1e-2) either way."""
    from kiln.graph import GENERATED_BYTES_HELD
    assert n < 100 or 2 * n * n > GENERATED_BYTES_HELD
    monkeypatch.setattr(attention, "FUSED_DEVICES", ("cuda", "cpu"))
    torch.manual_seed(0)
    nodes, errors, eager = _attention_nodes(PositionMasked(shift, hidden), torch.randn(2, n, 128))
    assert sorted(n.definition.name for n in nodes) == ["attention_backward", "attention_forward"]
    for n in nodes:
        n = n.attrs["fused_graph"].nodes[n.attrs["anchor"]] if "fused_graph" in n.attrs else n
        masks = [t for t in n.inputs if t.dtype.is_bool]
        assert n.attrs["is_causal"] is bool(causal) and len(masks) == (causal is None)
    for g, e in zip(errors, eager):
        assert g <= 2 * e + 1e-2, (g, e)
