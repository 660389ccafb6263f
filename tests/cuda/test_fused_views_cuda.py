"""Transformer attention blocks on a GPU through torch.compile(backend="kiln"), in 16 bits,
against a float64 reference next to eager's own error: the views around attention (heads split
by view + transpose, GPT-2's split of one fused projection, the heads merged back, Llama's
rotary embedding, nn.MultiheadAttention) are index arithmetic inside the GEMM and attention
kernels, and every projection runs on its best template (once, the heads' transposes made the
Q/K/V projections fall to the SIMT GEMM and left copy kernels around the attention). Separate
Q/K/V projections of one input merge into one GEMM (`MergeSiblingLinears`)."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kiln.schedule import device_arch, schedules_for

from tests.frontend.frontend_support import Capture

pytestmark = pytest.mark.cuda

E, H = 256, 4


class SelfAttention(nn.Module):
    """BERT's form: one projection each, heads split by view + transpose."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(E, E) for _ in range(4))

    def forward(self, x):
        b, s, _ = x.shape
        heads = lambda t: t.view(b, s, H, E // H).transpose(1, 2)
        a = F.scaled_dot_product_attention(heads(self.q(x)), heads(self.k(x)), heads(self.v(x)))
        return self.o(a.transpose(1, 2).reshape(b, s, E)) + x


class FusedProjection(nn.Module):
    """GPT-2's form: one projection of 3E split into q, k and v, causal."""

    def __init__(self):
        super().__init__()
        self.qkv, self.o = nn.Linear(E, 3 * E), nn.Linear(E, E)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, H, E // H).permute(0, 2, 1, 3) for t in self.qkv(x).split(E, dim=2))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(a.permute(0, 2, 1, 3).contiguous().view(b, s, E))


class Rotary(nn.Module):
    """Llama's form: rotary embedding on q and k after the head split, grouped-query heads."""

    def __init__(self):
        super().__init__()
        self.q, self.o = nn.Linear(E, E, bias=False), nn.Linear(E, E, bias=False)
        self.k, self.v = nn.Linear(E, E // 2, bias=False), nn.Linear(E, E // 2, bias=False)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        d = E // H

        def rope(t):
            half = torch.cat((-t[..., d // 2:], t[..., :d // 2]), dim=-1)
            return t * cos + half * sin

        q = rope(self.q(x).view(b, s, H, d).transpose(1, 2))
        k = rope(self.k(x).view(b, s, H // 2, d).transpose(1, 2))
        v = self.v(x).view(b, s, H // 2, d).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o(a.transpose(1, 2).reshape(b, s, E))


class MultiheadBlock(nn.Module):
    """torchvision ViT's form: nn.MultiheadAttention, batch first, no weights returned."""

    def __init__(self):
        super().__init__()
        self.attention = nn.MultiheadAttention(E, H, batch_first=True)

    def forward(self, x):
        return self.attention(x, x, x, need_weights=False)[0]


# model: (inputs for a batch and a sequence length, the kernels it should take)
CASES = {
    "self_attention": (SelfAttention, lambda b, s: [(b, s, E)], 3),
    "fused_projection": (FusedProjection, lambda b, s: [(b, s, E)], 3),
    "rotary": (Rotary, lambda b, s: [(b, s, E), (s, E // H), (s, E // H)], None),
    "multihead": (MultiheadBlock, lambda b, s: [(b, s, E)], 3),
}


def _relative_error(got, want):
    return ((got.double() - want).norm() / want.norm()).item()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("batch,length", [(2, 128), (3, 77)])
@pytest.mark.parametrize("case", list(CASES))
def test_attention_blocks_match_and_keep_their_templates(case, batch, length, dtype):
    make, shapes, kernels = CASES[case]
    torch.manual_seed(batch * length)
    model = make().cuda().eval()
    inputs = [torch.randn(s, device="cuda") for s in shapes(batch, length)]
    with torch.no_grad():
        want = model.double()(*[t.double() for t in inputs])
        model = model.to(dtype)
        low = [t.to(dtype) for t in inputs]
        eager = model(*low)
        capture = Capture()
        torch._dynamo.reset()
        got = torch.compile(model, backend=capture, fullgraph=True)(*low)
    assert capture.compiled, "the Kiln backend was never called"
    assert got.dtype == dtype and torch.isfinite(got).all()
    assert _relative_error(got, want) <= 2 * _relative_error(eager, want) + 1e-3
    graph = next(iter(capture.compiled[0].graphs.values())).graph
    nodes = [n for n in graph.nodes if n.name != "Constant"]
    for node in nodes:
        name = node.definition.name
        if name in ("linear", "matmul", "attention"):
            best = schedules_for(node.task, "cuda", device_arch(node.device))[0].name
            assert best in ("gemm_sm90", "gemv", "gemv_tc", "attention_flash", "attention_sm90", "matmul_tc"), (name, best)
    if kernels is not None:
        assert len(nodes) == kernels, [n.name for n in nodes]
