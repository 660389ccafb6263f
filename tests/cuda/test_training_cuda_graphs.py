"""Training through CUDA graphs without copies of the saved values or the gradients: the
forward's capture lends the values it saves for the backward (aliases of its static buffers),
the backward's capture reads them in place and lends its gradients, and a capture whose lent
values are still alive (two forwards before a backward, a retained graph, gradients kept for
accumulation) is left for another capture instead of being overwritten. Losses and gradients
against the same model run eagerly."""
import copy
import gc
import weakref

import pytest
import torch

from kiln.frontend.torch.backend import CompiledRun, KilnFunction
from tests.cuda.training_graphs_support import assert_same_gradients

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("fresh_dynamo")]


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.LayerNorm(96),
                               torch.nn.Linear(96, 32)).cuda()


_EARLIER = weakref.WeakSet()


@pytest.fixture(autouse=True)
def _earlier_functions():
    """Compiled functions that other tests of this process left alive (a failed test's traceback
    holds its model) are not this test's: remember them, so `_captures` leaves them out."""
    gc.collect()
    _EARLIER.clear()
    _EARLIER.update(KilnFunction.live())


def _captures(backward: bool) -> list[list]:
    """The captures of each compiled forward (or backward: lending from output 0) graph of this
    test that is still alive and replayed as a CUDA graph."""
    gc.collect()
    return [list(run.captures.values()) for f in KilnFunction.live() if f not in _EARLIER
            for run in f.graphs.values() if run.captures and (f.lent_from == 0) == backward]


def _forward_and_backward() -> tuple[list, list]:
    """The captures of the one forward graph and of the one backward graph."""
    forward, backward = _captures(False), _captures(True)
    assert len(forward) == len(backward) == 1, "a forward and a backward graph, each captured"
    return forward[0], backward[0]


def _backward_both(compiled, model, reference, optimizers):
    """The gradients of one random batch's loss through the compiled model and through the
    reference, each after its optimizer's zero_grad(), compared."""
    x = torch.randn(48, 64, device="cuda")
    for m, opt in zip((compiled, reference), optimizers):
        opt.zero_grad()
        m(x).square().mean().backward()
    assert_same_gradients(model, reference)


def test_steps_lend_saved_values_and_read_them_in_place():
    torch.backends.cuda.matmul.allow_tf32 = False
    model = _model()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="kiln")
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference)]
    for _ in range(4):
        _backward_both(compiled, model, reference, optimizers)
        for opt in optimizers:
            opt.step()
    forward, backward = _forward_and_backward()
    assert len(forward) == 1 and len(backward) == 1, "each step replays one capture"
    # a forward captured before its backward needed a larger workspace moves to the backward's
    # at the next step, and the backward's capture reading the old forward's values is dropped
    assert forward[0]._order is backward[0]._order, "the forward and the backward share one workspace"
    assert forward[0].lent and backward[0].lent
    assert backward[0].bound, "the backward reads the lent values in place"
    assert set(backward[0].bound) <= set(range(len(backward[0].static_inputs)))
    assert all(backward[0].static_inputs[k] is None for k in backward[0].bound)


def test_parameters_are_read_in_place():
    """The forward's and the backward's captures read the parameters at their own memory (no
    copy into the graph's buffers each step); a parameter moved to new memory (`p.data = ...`)
    takes a new capture that reads it there."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model = _model()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="kiln")
    for step in range(3):
        x = torch.randn(48, 64, device="cuda")
        for m in (compiled, reference):
            m.zero_grad()
            m(x).square().mean().backward()
        assert_same_gradients(model, reference)
        if step == 1:
            for m in (model, reference):
                m[0].weight.data = m[0].weight.data * 0.5
    forward, backward = _forward_and_backward()
    assert len(forward) == 2, "new memory for a parameter takes a second capture"
    copied = [[tuple(t.shape) for t in c.static_inputs if t is not None] for c in forward]
    assert copied == [[(48, 64)]] * 2, "each capture copies in the batch alone"
    # before, the parameters the forward saves (the weights its backward multiplies by) were
    # copied into the backward's own buffers: a second copy of them, and a copy each step
    parameters = {tuple(p.shape) for p in model.parameters()}
    for c in backward:
        assert not {tuple(t.shape) for t in c.static_inputs if t is not None} & parameters


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
        assert_same_gradients(model, reference)
    forward, _ = _forward_and_backward()
    assert len(forward) == 2


@pytest.mark.parametrize("most", [4, CompiledRun.CAPTURES_MAX])
def test_forwards_whose_saved_values_stay_alive(monkeypatch, most):
    """Five forwards before any backward (one block's graph called for each of five layers):
    each finds the earlier captures busy lending their values and takes another, up to
    CAPTURES_MAX; beyond that a call runs without a CUDA graph. Each backward then reads
    its own forward's values."""
    monkeypatch.setattr(CompiledRun, "CAPTURES_MAX", most)
    torch.backends.cuda.matmul.allow_tf32 = False
    model = _model()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="kiln")
    xs = [torch.randn(48, 64, device="cuda") for _ in range(5)]
    losses = [compiled(x).square().mean() for x in xs]
    [forward] = _captures(False)
    # the first capture, lending the outputs too, was retired when the second call found it busy
    assert len(forward) == min(4, most)
    for x, loss in reversed(list(zip(xs, losses))):
        model.zero_grad()
        reference.zero_grad()
        loss.backward()
        reference(x).square().mean().backward()
        assert_same_gradients(model, reference)
    # the forward's captures moved to the backward's larger workspace: the next step captures anew
    again = [compiled(x).square().mean() for x in xs]
    torch.testing.assert_close(torch.stack(again), torch.stack(losses).detach())


def test_a_block_graph_called_for_each_layer_replays_from_the_second_step(caplog):
    """Six layers compiled each alone (as FSDP2 wraps a model's blocks) share one block graph:
    its forward takes a capture for each layer (each lends its values until the backward), its
    backward a capture reading each one's values. The captures settle within four steps (the
    forward's move to the backward's larger workspace, the parameters' memory found to differ
    from call to call and copied in from then on); from then on every call replays."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    layers = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh())
                                   for _ in range(6)]).cuda()
    reference = copy.deepcopy(layers)
    compiled = [torch.compile(layer, backend="kiln") for layer in layers]
    for step in range(6):
        caplog.clear()
        with caplog.at_level("INFO", logger="kiln"):
            x = torch.randn(48, 64, device="cuda")
            layers.zero_grad()
            reference.zero_grad()
            for model in (compiled, reference):
                h = x
                for layer in model:
                    h = layer(h)
                h.square().mean().backward()
        assert_same_gradients(layers, reference)
    assert "CUDA graph" not in caplog.text, "the last step replays the captures of the one before"
    assert sum(map(len, _captures(False))) == 6


def test_gradients_are_lent_to_the_parameters():
    """With zero_grad() dropping the gradients each step, the backward's one capture serves every
    step and the parameters' gradients are its static outputs, not copies."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model = _model()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="kiln")
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, reference)]
    for _ in range(3):
        _backward_both(compiled, model, reference, optimizers)
        _, backward = _forward_and_backward()
        assert len(backward) == 1
        lent = backward[0].lent_addresses
        assert any(p.grad.data_ptr() in lent for p in model.parameters()), "gradients are lent, not copied"
        for opt in optimizers:
            opt.step()


@pytest.mark.parametrize("keep", ["accumulate", "zero_in_place"])
def test_gradients_kept_alive_are_never_overwritten(keep, monkeypatch):
    """Gradients accumulated over steps (no zero_grad) or zeroed in place (set_to_none=False)
    keep the first capture's lent outputs alive as `.grad`: later backwards replay other
    captures and accumulate into them, as eager does, and from the third step on nothing is
    captured again."""
    import kiln.frontend.torch.backend as backend
    original, made = backend.capture, []

    def counted(*args, **kwargs):
        made.append(1)
        return original(*args, **kwargs)
    monkeypatch.setattr(backend, "capture", counted)
    torch.backends.cuda.matmul.allow_tf32 = False
    model = _model()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="kiln")
    captures_by_step = []
    for step in range(6):
        x = torch.randn(48, 64, device="cuda")
        for m in (model, reference):
            if keep == "zero_in_place" and step % 2 == 0:
                m.zero_grad(set_to_none=False)
        for m in (compiled, reference):
            m(x).square().mean().backward()
        assert_same_gradients(model, reference)
        captures_by_step.append(len(made))
    assert captures_by_step[-1] == captures_by_step[2], f"captures made by the end of each step: {captures_by_step}"


def test_parameters_at_new_memory_every_step_are_copied_in(monkeypatch):
    """FSDP gathers each layer's parameters into new memory at every step: after a parameter
    came at new memory twice, the graphs copy it in and replay, rather than capture at every call."""
    import kiln.frontend.torch.backend as backend
    original, made = backend.capture, []

    def counted(*args, **kwargs):
        made.append(1)
        return original(*args, **kwargs)
    monkeypatch.setattr(backend, "capture", counted)
    torch.backends.cuda.matmul.allow_tf32 = False
    model = _model()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="kiln")
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference)]
    old = []            # the parameters' earlier memory stays allocated: each step's is new
    captures_by_step = []
    for _ in range(8):
        for p in model.parameters():
            old.append(p.data)
            p.data = p.data.clone()
        _backward_both(compiled, model, reference, optimizers)
        for opt in optimizers:
            opt.step()
        captures_by_step.append(len(made))
    assert captures_by_step[-1] == captures_by_step[4], f"captures made by the end of each step: {captures_by_step}"
    forward, backward = _forward_and_backward()
    assert len(forward) == 1 and len(backward) == 1
    params = {p.data_ptr() for p in model.parameters()}
    assert not params & (forward[0].bound_addresses | backward[0].bound_addresses), "parameters are copied in"


def _forward_run() -> CompiledRun:
    gc.collect()
    [run] = [run for f in KilnFunction.live() if f not in _EARLIER and f.lent_from != 0
             for run in f.graphs.values() if run.captures]
    return run


def test_outputs_are_lent_until_a_caller_keeps_them_into_the_next_step():
    """Issue 32: a training forward copied its outputs out of its capture at every step (GPT-2's
    412 MB of logits, which the loss graph then copied in again). They are lent now, as its saved
    values are; a caller keeping one step's outputs into the next (`out = model(x)` at loop scope)
    finds them unchanged, and gets copies from the capture made then (the lending one retired)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model = _model()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="kiln")
    kept = []
    for step in range(5):
        x = torch.randn(48, 64, device="cuda")
        model.zero_grad()
        reference.zero_grad()
        out, want = compiled(x), reference(x)
        torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)
        lent = set().union(*(c.lent_addresses for c in _forward_run().captures.values()))
        assert (out.data_ptr() in lent) == (step < 3), f"step {step}: lent until a caller kept outputs"
        if step == 2:
            kept.append((out, out.detach().clone()))
        out.square().mean().backward()
        want.square().mean().backward()
        assert_same_gradients(model, reference)
        for old, value in kept:
            torch.testing.assert_close(old, value, atol=0, rtol=0)
        del out, want
    run = _forward_run()
    assert not run.lends_user_outputs
    assert len(run.captures) == 1, "the lending capture was retired"


def test_dynamo_reset_frees_the_captures_memory():
    """torch._dynamo.reset() releases the CUDA graphs of every live compiled graph (the
    backward stays reachable through AOTAutograd): their saved values and workspace are freed."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)).cuda()
    x = torch.randn(2048, 1024, device="cuda")
    compiled = torch.compile(model, backend="kiln")
    for _ in range(3):
        compiled(x).square().mean().backward()
        model.zero_grad(set_to_none=True)
    gc.collect()
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    torch._dynamo.reset()
    gc.collect()
    assert torch.cuda.memory_allocated() <= held - 2048 * 4096 * 4, "a saved [2048, 4096] float32 value is freed"
