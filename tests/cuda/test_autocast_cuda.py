"""torch.autocast("cuda") through torch.compile(backend="kiln"): eager's dtypes, and values within
twice eager's own error against a float32 reference (plus a little), float16 and bfloat16,
with CUDA graphs (the default) replaying the casts."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytestmark = pytest.mark.cuda


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(64), nn.Linear(64, 256), nn.Linear(256, 64)
        self.q, self.k, self.v = (nn.Linear(64, 64) for _ in range(3))

    def forward(self, x):
        b, s, _ = x.shape
        heads = lambda t: t.view(b, s, 4, 16).transpose(1, 2)
        a = F.scaled_dot_product_attention(heads(self.q(x)), heads(self.k(x)), heads(self.v(x)))
        h = self.norm(x + a.transpose(1, 2).reshape(b, s, 64))
        return torch.softmax(self.down(F.gelu(self.up(h))), -1), h


def _error(got, want):
    return ((got.float() - want).norm() / want.norm()).item()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_autocast_region_around_the_compiled_call(dtype):
    torch.manual_seed(0)
    model, x = Block().cuda().eval(), torch.randn(3, 37, 64, device="cuda")
    torch._dynamo.reset()
    with torch.no_grad():
        want = model(x)                                   # float32 reference
        compiled = torch.compile(model, backend="kiln")
        with torch.autocast("cuda", dtype=dtype):
            eager = model(x)
            got = compiled(x)
            again = compiled(x + 1)                       # a replay with other values
            eager_again = model(x + 1)
    for g, e, w in zip(got, eager, want):
        assert g.dtype == e.dtype
        assert _error(g, w) <= 2 * _error(e, w) + 1e-3
    for g, e in zip(again, eager_again):
        assert g.dtype == e.dtype
        assert _error(g, e.float()) <= 2e-2
