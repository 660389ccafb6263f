"""torch._dynamo.reset() calls the backend's `reset`: every live KilnFunction lets go of its
plans (and on a GPU its CUDA graphs), including those still reachable after dynamo forgot them
(AOTAutograd keeps a training graph's compiled backward); a call after it plans again and
matches eager."""
import copy

import torch

from kiln.frontend.torch import KilnFunction


def test_reset_releases_every_plan_and_a_later_call_plans_again():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.GELU(), torch.nn.Linear(8, 3))
    reference = copy.deepcopy(model)
    x = torch.randn(5, 6)
    before = set(KilnFunction.live())
    compiled = torch.compile(model, backend="kiln")
    compiled(x).sum().backward()
    functions = [f for f in KilnFunction.live() if f not in before]
    assert len(functions) == 2 and all(f.graphs for f in functions)     # forward and backward
    torch._dynamo.reset()
    assert not any(f.graphs for f in functions)
    model.zero_grad()
    out = compiled(x)
    out.sum().backward()
    reference(x).sum().backward()
    torch.testing.assert_close(out, reference(x))
    for p, r in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, r.grad)
