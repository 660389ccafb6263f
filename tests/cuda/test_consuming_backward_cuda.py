"""A training backward's CUDA graph puts its gradients and intermediates in the memory of the
values the forward saved for it, once it has read them (`kiln.runtime.cuda_graph.capture`,
`reused`), where autograd is done with them: gradients equal eager's step after step, and a
saved_tensors_hooks that keeps the saved values, or gradients kept alive into the next step,
leave those values alone. (A retained graph never reaches it: AOTAutograd refuses
retain_graph=True for a backward with donated buffers, as a consuming backward's saved values are.)"""
import copy
import gc
import logging

import pytest
import torch

from kiln.frontend.torch.backend import KilnFunction
from kiln.runtime import cuda
from tests.cuda.training_graphs_support import assert_same_gradients

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("fresh_dynamo")]


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.LayerNorm(256),
                               torch.nn.Linear(256, 256), torch.nn.Tanh(), torch.nn.Linear(256, 32)).cuda()


def _compiled(reuse: bool = True):
    """A model, its eager copy and the model compiled by Kiln (with the consuming backward where
    `reuse`; None: the default)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model = _model()
    options = {} if reuse is None else {"reuse_saved_memory": reuse}
    return model, copy.deepcopy(model), torch.compile(model, backend="kiln", options=options)


def _step(model, reference, compiled):
    """One step of a random batch through the compiled model and its eager copy, each after
    zero_grad: their gradients compared."""
    x = torch.randn(512, 64, device="cuda")
    for m in (compiled, reference):
        m.zero_grad()
        m(x).square().mean().backward()
    assert_same_gradients(model, reference)


def _graph_captures(model_functions, backward: bool) -> list:
    gc.collect()
    return [c for f in KilnFunction.live() if f not in model_functions and (f.lent_from == 0) == backward
            for run in f.graphs.values() if run.captures for c in run.captures.values()]


def _inside(tensor, memory) -> bool:
    return memory.data_ptr() <= tensor.data_ptr() < memory.data_ptr() + memory.untyped_storage().nbytes()


@pytest.fixture
def earlier():
    gc.collect()
    return set(KilnFunction.live())


def test_gradients_go_into_the_saved_values_memory(earlier):
    model, reference, compiled = _compiled()
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, reference)]
    for step in range(4):
        x = torch.randn(512, 64, device="cuda")
        for m, opt in zip((compiled, reference), optimizers):
            opt.zero_grad()
            m(x).square().mean().backward()
        assert_same_gradients(model, reference)
        for opt in optimizers:
            opt.step()
        if step == 0:       # the forward's first capture moved to the backward's larger workspace
            continue
        [backward] = _graph_captures(earlier, True)
        [forward] = _graph_captures(earlier, False)
        assert set(backward.lenders) == {forward}, "the backward consumes the forward's saved values"
        saved = [t for t in forward.static_outputs if t is not None and t.data_ptr() in forward.private_addresses]
        assert any(_inside(p.grad, s) for p in model.parameters() for s in saved), \
            "some gradient lies in the memory of a saved value"
        assert forward.busy(), "the forward's saved memory holds gradients the parameters still hold"


def test_steps_after_the_first_capture_nothing(caplog):
    """The first backward's larger workspace retires the first forward capture, so the first
    consuming capture serves one replay; the next forward captures on that workspace, and from
    then on each step replays (regression: the workspace was freed with the one-replay capture,
    the next forward captured on a small one again, and every step captured both graphs anew)."""
    model, reference, compiled = _compiled()
    for step in range(6):
        if step == 2:
            caplog.set_level(logging.INFO, logger="kiln")
            caplog.clear()
        _step(model, reference, compiled)
    assert "capturing a CUDA graph" not in caplog.text


def test_the_first_consuming_capture_runs_nothing_before_it(caplog):
    """Where the driver loads kernels inside a capture, the first consuming capture makes no
    run on a workspace of its own before it (regression: that run put a second workspace and a
    second set of gradients on top of the first step's memory, ResNet-50's peak)."""
    assert cuda.loads_kernels_in_capture(), "this driver is older than CUDA 12.3"
    caplog.set_level(logging.DEBUG, logger="kiln")
    model, reference, compiled = _compiled()
    for _ in range(3):
        _step(model, reference, compiled)
    assert "a run on a workspace of its own" not in caplog.text


def test_the_first_capture_warms_up_before_its_workspace_grows(earlier):
    """The first consuming capture loads its kernels by a run on a workspace of its own (the plan
    that reuses no saved memory), its gradients beside it; that memory is freed before the shared
    workspace grows to the capture's size. Before, the shared workspace grew first and the first
    backward held both (ResNet-50 b32 bf16: the ~210 MB consuming workspace beside the 310 MB plain
    one and 102 MB of gradients, which put its peak above the backward that does not consume)."""
    model, reference, compiled = _compiled()
    x = torch.randn(16384, 64, device="cuda")
    loss = compiled(x).square().mean()
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - start
    reference(x).square().mean().backward()
    assert_same_gradients(model, reference)
    gc.collect()
    runs = {f.lent_from == 0: r for f in KilnFunction.live() if f not in earlier for r in f.graphs.values()}
    forward, backward = runs[False], runs[True]
    plain = sum(p.size for p in backward.compiled.plans.values())
    consuming = backward.workspace.buffer.numel()
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    slack = 4 << 20      # the output's gradient, its copy in the workspace, kernels' temporaries
    assert min(plain, consuming) > sum(p.size for p in forward.compiled.plans.values()) + 2 * slack, \
        "both workspaces outgrow the forward's: held together, they would show"
    assert peak <= max(plain, consuming) + grads + slack


def test_saved_values_a_hook_keeps_are_left_alone(earlier):
    """A saved_tensors_hooks pack hook that keeps the saved tensors sees them unchanged after the
    backward, and the steps after it stay right. The steps before it consumed; the capture that
    served the hooked step does not consume, and keeps serving the later steps."""
    model, reference, compiled = _compiled()
    consumed = False
    for step in range(4):
        x = torch.randn(512, 64, device="cuda")
        kept, copies = [], []

        def pack(t):
            kept.append(t)
            copies.append(t.detach().clone())
            return t

        for m in (compiled, reference):
            m.zero_grad()
            if step == 2:
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    loss = m(x).square().mean()
            else:
                loss = m(x).square().mean()
            loss.backward()
        assert_same_gradients(model, reference)
        for t, c in zip(kept, copies):
            torch.testing.assert_close(t, c, atol=0, rtol=0)
        if step == 1:
            consumed = any(c.lenders for c in _graph_captures(earlier, True))
    assert consumed


def test_gradients_kept_into_the_next_steps(earlier):
    """Gradients accumulated without zero_grad may sit in a forward capture's saved memory:
    that capture is busy while they live, and every step's gradients add up as eager's do."""
    model, reference, compiled = _compiled()
    for step in range(5):
        x = torch.randn(512, 64, device="cuda")
        for m in (compiled, reference):
            m(x).square().mean().backward()
        assert_same_gradients(model, reference)
    assert len(_graph_captures(earlier, False)) <= 2, "the captures settle"


@pytest.mark.parametrize("reuse", [None, False])
def test_on_by_default_and_off_by_the_option(earlier, reuse):
    model, reference, compiled = _compiled(reuse=reuse)
    for _ in range(2):
        _step(model, reference, compiled)
    assert any(c.lenders for c in _graph_captures(earlier, True)) == (reuse is None)


def test_a_gradient_larger_than_each_saved_value_goes_into_their_block(earlier):
    """The forward's saved values lie side by side in one block, so that once the backward has
    read several of them their memory is one stretch: the embedding's gradient, computed last
    and larger than any one saved value, lies in that block. Before, each saved value was an
    allocation of its own, and only gradients that fit one of them went there (the Llama-style
    1B's backward kept 950 MB of gradients in memory of its own from step to step, 710 since)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(768, 256), torch.nn.Tanh(), torch.nn.Linear(256, 256),
                                torch.nn.Tanh(), torch.nn.Linear(256, 256), torch.nn.Tanh(),
                                torch.nn.Linear(256, 32)).cuda()
    reference, compiled = copy.deepcopy(model), torch.compile(model, backend="kiln")
    for _ in range(3):
        ids = torch.randint(0, 768, (512,), device="cuda")
        for m in (compiled, reference):
            m.zero_grad()
            m(ids).square().mean().backward()
        assert_same_gradients(model, reference)
    [forward] = _graph_captures(earlier, False)
    saved = [t for t in forward.static_outputs if t is not None and t.data_ptr() in forward.private_addresses]
    [block] = {t.untyped_storage().data_ptr(): t.untyped_storage() for t in saved}.values()
    grad = model[0].weight.grad
    assert grad.numel() * grad.element_size() > max(t.numel() * t.element_size() for t in saved)
    assert block.data_ptr() <= grad.data_ptr() < block.data_ptr() + block.nbytes()
