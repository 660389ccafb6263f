"""The torch backend runs the passes on every graph it compiles, under the caller's
PassContext, with dynamo_config's float16 settings."""
import io

import pytest
import torch

import kiln
from kiln.frontend.torch import dynamo_config
from kiln.passes import PrintGraph
from kiln.runtime.backend import CompiledTask


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 16)
        self.norm = torch.nn.LayerNorm(16)

    def forward(self, x):
        return self.norm(torch.nn.functional.gelu(self.fc(x)) * 2.0 + 1.0)


def _launches(model, x, **ctx):
    """(kernel launches of one forward, output) of a fresh compile under PassContext(**ctx)."""
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="kiln")
    with torch.no_grad():
        with kiln.PassContext(**ctx):
            compiled(x)
        calls = []
        original = CompiledTask.__call__
        CompiledTask.__call__ = lambda self, *a, **k: calls.append(1) or original(self, *a, **k)
        try:
            out = compiled(x)
        finally:
            CompiledTask.__call__ = original
    return len(calls), out


@pytest.fixture
def fp16():
    dynamo_config.use_fp16(True)
    yield
    dynamo_config.reset()


def test_backend_fuses_unless_the_caller_turns_passes_off():
    model, x = Block().eval(), torch.randn(4, 8)
    plain, out0 = _launches(model, x, opt_level=0)
    fused, out = _launches(model, x)
    assert (plain, fused) == (5, 2)         # linear, gelu, mul, add, layer_norm / linear+..., layer_norm
    with torch.no_grad():
        expected = model(x)
    torch.testing.assert_close(out0, expected)
    torch.testing.assert_close(out, expected)


def test_backend_float16(fp16):
    model, x = Block().eval(), torch.randn(4, 8)
    printed = io.StringIO()
    _, out = _launches(model, x, instruments=[PrintGraph(before=False, file=printed)])
    converted = printed.getvalue().split("# after convert_to_float16\n")[1].split("\n}")[0]
    assert "Constant(float16[16, 8][cpu])" in converted and "Cast(x, dtype='float16')" in converted
    with torch.no_grad():
        expected = model(x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)
