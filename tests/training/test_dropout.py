"""Dropout in training through Kiln: a counter-based generator seeded from torch's generator at
every call, statistically (not bitwise) equivalent to eager."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from training_support import bert_case, train


class Scaled(nn.Module):
    """dropout(x * w) with a learnable scalar w."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p
        self.w = nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        return F.dropout(x * self.w, self.p, training=True)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_mask_density_scaling_and_gradient(p):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Scaled(p)
    x = torch.rand(301, 997) + 0.5          # no zeros of its own
    compiled = torch.compile(model, backend="kiln")
    y = compiled(x)
    assert y.requires_grad
    kept = y != 0
    density = kept.float().mean().item()
    assert abs(density - (1 - p)) < 0.01, f"kept fraction {density}, expected {1 - p}"
    torch.testing.assert_close(y[kept], (x * 1.5)[kept] / (1 - p), rtol=1e-6, atol=0)
    y.sum().backward()
    expected = (x * kept).sum() / (1 - p)   # the gradient uses the forward's own mask
    torch.testing.assert_close(model.w.grad, expected, rtol=1e-4, atol=0)

    rows, cols = kept.float().mean(1), kept.float().mean(0)
    assert (rows - (1 - p)).abs().max() < 0.1 and (cols - (1 - p)).abs().max() < 0.1
    neighbours = torch.corrcoef(torch.stack([kept[:, :-1].flatten(), kept[:, 1:].flatten()]).float())
    assert abs(neighbours[0, 1].item()) < 0.02, "masks of neighbouring elements are correlated"

    again = compiled(x) != 0
    same = (again == kept).float().mean().item()
    assert abs(same - (p * p + (1 - p) * (1 - p))) < 0.01, "each call must draw a fresh mask"
    torch.manual_seed(0)
    first = compiled(x) != 0
    torch.manual_seed(0)
    assert torch.equal(compiled(x) != 0, first), "torch.manual_seed must make masks repeatable"


@pytest.mark.slow
def test_bert_with_dropout_tracks_eager_loss_curve():
    """50 AdamW steps with dropout 0.1: Kiln's curve stays as close to eager's as a second eager
    run with other random numbers does."""
    pytest.importorskip("transformers")
    model, batches = bert_case(dropout=0.1)
    steps = 50
    eager = train(model, batches, "adamw", steps, seed=1).losses
    other = train(model, batches, "adamw", steps, seed=2).losses
    torch._dynamo.reset()
    run = train(model, batches, "adamw", steps, compile_with="kiln", seed=1)
    assert run.kiln_graphs >= 2
    kiln = run.losses

    def distance(a, b):
        return sum(abs(u - v) for u, v in zip(a, b)) / steps

    noise = distance(eager, other)
    assert noise > 0, "dropout must make runs with other seeds differ"
    assert distance(kiln, eager) <= 2 * noise + 0.02, (distance(kiln, eager), noise)
    start, end = sum(kiln[:10]) / 10, sum(kiln[-10:]) / 10
    eager_end = sum(eager[-10:]) / 10
    assert end < start and abs(end - eager_end) <= 0.1 * eager_end + 3 * noise
