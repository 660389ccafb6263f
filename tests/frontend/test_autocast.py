"""torch.autocast through torch.compile(backend="kiln"): the dtypes and values eager gives,
with the region around the compiled call, inside the compiled function, nested, and in
training (AOTAutograd)."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

LOW = [torch.bfloat16, torch.float16]


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(24), nn.Linear(24, 40), nn.Linear(40, 24)

    def forward(self, x):
        h = self.down(F.gelu(self.up(self.norm(x))))
        return torch.softmax(h + x, -1), h.sum(-1)


def _close(got, want):
    for g, w in zip(got, want):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g.float(), w.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_a_region_around_the_compiled_call(dtype):
    torch.manual_seed(0)
    model, x = Block().eval(), torch.randn(3, 7, 24)
    torch._dynamo.reset()
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
        want = model(x)
        got = torch.compile(model, backend="kiln")(x)
    assert want[0].dtype == torch.float32 and want[1].dtype == dtype   # softmax runs in float32
    _close(got, want)


def test_regions_inside_the_compiled_function_nest():
    torch.manual_seed(1)
    model, x = Block().eval(), torch.randn(5, 24)

    def f(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            a = model.up(x)
            with torch.autocast("cpu", enabled=False):
                b = model.up(x)                         # float32 again
            c = model.down(F.relu(a))
        return a, b, c, c.float() * 2

    torch._dynamo.reset()
    with torch.no_grad():
        want = f(x)
        got = torch.compile(f, backend="kiln")(x)
    assert [t.dtype for t in want] == [torch.bfloat16, torch.float32, torch.bfloat16, torch.float32]
    _close(got, want)


def test_training_steps_under_autocast():
    torch.manual_seed(2)
    eager = Block()
    compiled_model = Block()
    compiled_model.load_state_dict(eager.state_dict())
    step = torch.compile(lambda m, x: m(x)[0].square().mean(), backend="kiln")
    losses = {}
    for name, model in (("eager", eager), ("kiln", compiled_model)):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        torch.manual_seed(3)
        losses[name] = []
        for _ in range(3):
            x = torch.randn(4, 7, 24)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(x)[0].square().mean() if name == "eager" else step(model, x)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[name].append(loss.item())
    torch.testing.assert_close(losses["kiln"], losses["eager"], rtol=2e-2, atol=1e-4)
