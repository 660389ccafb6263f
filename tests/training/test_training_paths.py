"""Which path a graph takes (inference through torch-level rules, training through AOTAutograd
and ATen-level rules) and how unmapped ATen operators are reported or run in PyTorch."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kiln
from kiln.frontend.torch import KilnFunction, kiln_backend


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


class ConvHead(nn.Module):
    """A convolution, an adaptive average pool to 3x3 (its backward is an ATen op Kiln does not
    map) and a sum of squares."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3)

    def forward(self, x):
        return F.adaptive_avg_pool2d(self.conv(x), 3).square().sum()


class Backends:
    """A torch.compile backend recording what kiln_backend returned."""

    def __init__(self):
        self.returned = []

    def __call__(self, gm, example_inputs):
        self.returned.append(kiln_backend(gm, example_inputs))
        return self.returned[-1]


def test_outputs_carry_gradients_of_parameters():
    """The issue's report: a compiled model's outputs came back with requires_grad=False."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 5), nn.GELU(), nn.Linear(5, 3))
    x = torch.randn(4, 7)
    out = torch.compile(model, backend="kiln")(x)
    assert out.requires_grad and out.grad_fn is not None
    out.square().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).square().sum().backward()
    for got, p in zip(grads, model.parameters()):
        torch.testing.assert_close(got, p.grad, rtol=1e-5, atol=1e-6)


def test_input_gradients_without_parameters():
    def f(x, y):
        return (torch.softmax(x @ y.t(), -1) * x.sum(1, keepdim=True)).sum()
    torch.manual_seed(0)
    x, y = torch.randn(5, 6, requires_grad=True), torch.randn(3, 6, requires_grad=True)
    torch.compile(f, backend="kiln")(x, y).backward()
    got = x.grad.clone(), y.grad.clone()
    x.grad = y.grad = None
    f(x, y).backward()
    torch.testing.assert_close(got, (x.grad, y.grad), rtol=1e-5, atol=1e-6)


def test_inference_keeps_the_torch_level_path():
    model = nn.Linear(4, 2)
    backend = Backends()
    with torch.no_grad():
        out = torch.compile(model, backend=backend)(torch.randn(3, 4))
    assert not out.requires_grad
    assert isinstance(backend.returned[0], KilnFunction), "no_grad must not go through AOTAutograd"
    torch._dynamo.reset()
    out = torch.compile(model, backend=backend)(torch.randn(3, 4))
    assert out.requires_grad and not isinstance(backend.returned[1], KilnFunction)


def test_unmapped_backward_operator_is_one_clear_error():
    torch.manual_seed(0)
    loss = torch.compile(ConvHead(), backend="kiln")(torch.randn(2, 2, 9, 9))
    with pytest.raises(kiln.UnmappedOperatorError) as info:
        loss.backward()     # the backward graph is compiled when autograd first needs it
    assert [(o.name, o.count) for o in info.value.operators] == [
        ("aten._adaptive_avg_pool2d_backward.default", 1)]
    assert "fallback_to_eager(True)" in str(info.value)


def test_unmapped_forward_operator_is_one_clear_error():
    x = torch.randn(3, 5, requires_grad=True)
    with pytest.raises(Exception) as info:
        torch.compile(lambda t: (t.cumsum(1) * t.cummax(1).values).sum(), backend="kiln")(x)
    error = getattr(info.value, "inner_exception", info.value)  # dynamo wraps backend errors
    assert isinstance(error, kiln.UnmappedOperatorError), repr(info.value)
    assert {o.name for o in error.operators} == {"aten.cummax.default"}     # cumsum is mapped


def test_fallback_runs_unmapped_backward_operator_in_pytorch():
    kiln.torch.dynamo_config.fallback_to_eager(True)
    torch.manual_seed(0)
    model, x = ConvHead(), torch.randn(2, 2, 9, 9)
    with pytest.warns(UserWarning, match="aten._adaptive_avg_pool2d_backward.default"):
        torch.compile(model, backend="kiln")(x).backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).backward()
    for g, p in zip(got, model.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-6)


def test_fallback_runs_dropout_when_no_rule_maps_the_generator():
    """With the random op run in PyTorch (fallback), dropout still trains: the seeded node runs
    torch's own generator."""
    kiln.torch.dynamo_config.fallback_to_eager(True)
    from kiln.frontend.torch import mapping_registry
    from kiln.frontend.torch.random import seeded_uniform
    removed = mapping_registry().remove(seeded_uniform)
    try:
        x = torch.rand(64, 33) + 0.5
        w = torch.tensor(2.0, requires_grad=True)
        with pytest.warns(UserWarning, match="seeded_uniform"):
            y = torch.compile(lambda t: F.dropout(t * w, 0.25, training=True), backend="kiln")(x)
        kept = y != 0
        assert abs(kept.float().mean().item() - 0.75) < 0.03
        y.sum().backward()
        torch.testing.assert_close(w.grad, (x * kept).sum() / 0.75, rtol=1e-4, atol=0)
    finally:
        for rule in removed:
            mapping_registry().add(rule)


def test_symbolic_trace_graph_returning_one_tensor():
    """fx graphs of symbolic_trace may return a bare tensor (AOTAutograd wants a tuple)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4), nn.Tanh())
    gm = torch.fx.symbolic_trace(model)
    x = torch.randn(3, 6)
    out = kiln_backend(gm, [x])(x)
    assert isinstance(out, torch.Tensor) and out.requires_grad
    out.sum().backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).sum().backward()
    torch.testing.assert_close(got, [p.grad for p in model.parameters()], rtol=1e-5, atol=1e-6)


def test_rule_declared_with_decompose_false_sees_the_op_whole():
    """aten.hardswish is in torch's core-ATen decomposition table: a rule declared with
    decompose=False takes it out, and AOTAutograd hands the op itself to the rule."""
    from kiln.frontend.torch import mapping_registry, register_function
    from kiln.frontend.torch.training import decompositions
    hardswish = torch.ops.aten.hardswish.default
    seen = []

    @register_function(hardswish, priority=10, decompose=False)
    def whole(x):
        seen.append(x.shape)
        return kiln.ops.hardswish(x)

    try:
        assert hardswish not in decompositions()
        x = torch.randn(3, 5, requires_grad=True)
        torch.compile(F.hardswish, backend="kiln")(x).sum().backward()
        assert seen == [(3, 5)]
        torch.testing.assert_close(x.grad, torch.func.grad(lambda t: F.hardswish(t).sum())(x))
    finally:
        mapping_registry().remove(hardswish, handler=whole)
    assert hardswish in decompositions()


def test_a_decomposition_registered_by_a_plugin_replaces_torchs():
    """register_decomposition gives AOTAutograd Kiln's decomposition of an ATen overload in place
    of torch's: the training graph holds the operations it makes (here hardswish written with
    clamp, traced on the example), and its gradient follows them."""
    from kiln.frontend.torch import mapping_registry, register_decomposition
    from kiln.frontend.torch.training import decompositions
    hardswish = torch.ops.aten.hardswish.default
    traced = []

    @register_decomposition(hardswish, priority=10)
    def clamped(x):
        traced.append(x.shape)
        return x * torch.clamp(x + 3, 0, 6) / 6

    try:
        assert decompositions()[hardswish] is clamped
        x = torch.randn(3, 5, requires_grad=True)
        torch.compile(F.hardswish, backend="kiln")(x).sum().backward()
        assert traced == [(3, 5)]
        torch.testing.assert_close(x.grad, torch.func.grad(lambda t: F.hardswish(t).sum())(x))
    finally:
        mapping_registry().remove(hardswish, handler=clamped)
    assert decompositions()[hardswish] is not clamped


def test_rules_read_the_strides_pytorch_traced():
    """traced_argument(k) gives a rule (here a check that declines) the tensor PyTorch traced
    argument k as: channels_last strides, which Kiln's values do not have."""
    from kiln.frontend.torch import mapping_registry, register_function, traced_argument
    strides = []

    def record(x, other):
        strides.append(traced_argument(0).stride())
        return False

    @register_function(torch.ops.aten.mul.Tensor, priority=10, check=record)
    def never(x, other):
        raise AssertionError("the check declines every call")

    try:
        x = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last).requires_grad_(True)
        torch.compile(lambda t: t * t, backend="kiln")(x)
        assert strides[0] == (60, 1, 15, 3) and traced_argument(0) is None
    finally:
        mapping_registry().remove(torch.ops.aten.mul.Tensor, handler=never)
