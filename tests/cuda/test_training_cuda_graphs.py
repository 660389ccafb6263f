"""Training through CUDA graphs without copies of the saved values: the forward's capture lends
the values it saves for the backward (aliases of its static buffers), the backward's capture
reads them in place, and a forward whose lent values are still alive (two forwards before a
backward, a retained graph) takes another capture instead of overwriting them. Losses and
gradients against the same model run eagerly."""
import copy
import gc

import pytest
import torch

from kiln.frontend.torch.backend import KilnFunction

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("fresh_dynamo")]


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.LayerNorm(96),
                               torch.nn.Linear(96, 32)).cuda()


def _captures():
    """{id(CompiledRun): its captures} of every live compiled graph replayed as a CUDA graph."""
    gc.collect()
    return {id(run): list(run.captures.values()) for f in KilnFunction.live() for run in f.graphs.values()
            if run.captures}


def _assert_same_gradients(model, reference):
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-4, rtol=1e-4, msg=lambda m: f"{name}: {m}")


def test_steps_lend_saved_values_and_read_them_in_place():
    torch.backends.cuda.matmul.allow_tf32 = False
    model = _model()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="kiln")
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference)]
    for step in range(4):
        x = torch.randn(48, 64, device="cuda")
        for m, opt in zip((compiled, reference), optimizers):
            opt.zero_grad()
            (m(x).square().mean()).backward()
        _assert_same_gradients(model, reference)
        for opt in optimizers:
            opt.step()
    runs = list(_captures().values())
    assert len(runs) == 2, "a forward and a backward graph, each captured"
    forward = next(c for c in runs if c[0].lent)
    backward = next(c for c in runs if c is not forward)
    assert len(forward) == 1 and len(backward) == 1, "each step replays the first capture"
    assert backward[0].bound, "the backward reads the lent values in place"
    assert set(backward[0].bound) <= set(range(len(backward[0].static_inputs)))
    assert all(backward[0].static_inputs[k] is None for k in backward[0].bound)


def test_two_forwards_before_one_backward():
    """The first forward's lent values are alive when the second runs: it takes a second capture."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model = _model()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="kiln")
    for _ in range(3):
        a, b = torch.randn(48, 64, device="cuda"), torch.randn(48, 64, device="cuda")
        for m in (compiled, reference):
            (m(a).square().mean() + m(b).abs().mean()).backward()
        _assert_same_gradients(model, reference)
    forward = next(c for c in _captures().values() if c[0].lent)
    assert len(forward) == 2


def test_forwards_whose_saved_values_stay_alive():
    """Five forwards before any backward: four captures lend their values, the fifth call finds
    them all busy and runs without a CUDA graph; each backward then reads its own forward's."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model = _model()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="kiln")
    xs = [torch.randn(48, 64, device="cuda") for _ in range(5)]
    losses = [compiled(x).square().mean() for x in xs]
    forward = next(c for c in _captures().values() if c[0].lent)
    assert len(forward) == 4
    for x, loss in reversed(list(zip(xs, losses))):
        model.zero_grad()
        reference.zero_grad()
        loss.backward()
        reference(x).square().mean().backward()
        _assert_same_gradients(model, reference)
