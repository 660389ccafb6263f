"""torch.rand and torch.randn inside a compiled inference graph: the graph goes through
AOTAutograd, its random nodes are seeded from torch's generator at every call, and Kiln's
counter-based generator draws them (`random_uniform`, `random_normal`)."""
import math

import pytest
import torch

import kiln


def _noisy(x):
    return x + torch.randn_like(x), torch.rand(x.shape[0], 3) * 2


@pytest.fixture
def compiled():
    torch._dynamo.reset()
    return torch.compile(_noisy, backend="kiln")


def test_normal_and_uniform_numbers_have_their_distributions(compiled):
    torch.manual_seed(0)
    x = torch.full((400, 500), 3.0)
    with torch.no_grad():
        noisy, uniform = compiled(x)
    z = (noisy - 3.0).double()
    n = z.numel()
    assert abs(z.mean().item()) < 5 / math.sqrt(n)
    assert abs(z.std().item() - 1) < 0.01
    assert abs((z.abs() < 1).double().mean().item() - 0.6827) < 0.005      # the normal's one-sigma mass
    assert abs(z.pow(4).mean().item() - 3) < 0.1         # kurtosis 3 (its estimate's sd: 0.022), a uniform's 1.8
    assert torch.isfinite(z).all()
    assert uniform.shape == (400, 3) and uniform.min() >= 0 and uniform.max() < 2


def test_fresh_numbers_every_call_and_repeatable_under_manual_seed(compiled):
    x = torch.zeros(64, 64)
    with torch.no_grad():
        torch.manual_seed(7)
        first = compiled(x)[0]
        second = compiled(x)[0]
        torch.manual_seed(7)
        again = compiled(x)[0]
    assert not torch.equal(first, second)
    assert torch.equal(first, again)


def test_random_normal_operator_matches_its_definition_in_float16():
    seeds = kiln.from_torch(torch.tensor([[12345, 678], [9, 10]]))
    a = kiln.ops.random_normal(seeds, 0, (3, 1000), "float16").torch()
    b = kiln.ops.random_normal(seeds, 1, (3, 1000), "float16").torch()
    assert a.dtype == torch.float16 and torch.isfinite(a).all()
    assert not torch.equal(a, b)
    assert torch.equal(a, kiln.ops.random_normal(seeds, 0, (3, 1000), "float16").torch())
