"""What torch.compile users rely on, through torch.compile itself: modes, calls with no effect
on values, shape arithmetic at new sizes, rule results checked against dynamo's metadata,
clear errors for training mode, and in-place changes through views never giving wrong values."""
import warnings

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import nn

import kiln
from kiln.frontend.torch import Interpreter, MappingError, register_function
from kiln.frontend.torch.interpreter import NO_EFFECT_CALLS, RuleResultError
from kiln.graph import FlowGraph


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3)).eval()


@pytest.mark.parametrize("how", ["keyword", "options"])
def test_max_autotune_builds_kernels_at_tuning_level_2(how, monkeypatch):
    levels, compile_ = [], FlowGraph.compile

    def spy(self, settings=None):
        if self._compiled is None:          # the build, not a later run
            levels.append(settings.search_space)
        return compile_(self, settings)

    monkeypatch.setattr(FlowGraph, "compile", spy)
    model, x = _mlp(), torch.randn(3, 5)
    kwargs = {"mode": "max-autotune"} if how == "keyword" else {"options": {"mode": "max-autotune"}}
    with torch.no_grad():
        out = torch.compile(model, backend="kiln", **kwargs)(x)
    torch.testing.assert_close(out, model(x))
    assert levels and set(levels) == {2}


def test_default_mode_builds_at_level_0(monkeypatch):
    levels, compile_ = [], FlowGraph.compile
    monkeypatch.setattr(FlowGraph, "compile",
                        lambda self, settings=None: (self._compiled is None and levels.append(
                            settings.search_space)) or compile_(self, settings))
    with torch.no_grad():
        torch.compile(_mlp(), backend="kiln")(torch.randn(3, 5))
    assert levels and set(levels) == {0}


def test_an_unknown_mode_is_an_error_naming_the_valid_ones():
    with pytest.raises(Exception, match="does not know mode 'max-autotun'.*max-autotune"):
        torch.compile(_mlp(), backend="kiln", mode="max-autotun")(torch.randn(3, 5))


def test_the_usage_logging_call_compiles_and_is_never_unmapped():
    assert torch._C._log_api_usage_once in NO_EFFECT_CALLS

    def fn(x):
        torch._C._log_api_usage_once("kiln.test")
        return x.relu() * 2

    graphs = []

    def backend(gm, inputs):
        graphs.append(gm)
        return kiln.torch.kiln_backend(gm, inputs)

    x = torch.randn(4, 3)
    torch.testing.assert_close(torch.compile(fn, backend=backend, fullgraph=True)(x), fn(x))
    targets = [n.target for n in graphs[0].graph.nodes]
    assert torch._C._log_api_usage_once in targets       # dynamo kept it: Kiln dropped it
    assert Interpreter(graphs[0]).unmapped() == []
    assert kiln.torch.unmapped_operators(fn, x) == []


def test_tiny_gpt2_runs_at_new_sequence_lengths():
    """After a second length dynamo re-traces with SymInts, torch.Size and shape arithmetic;
    Kiln runs each length (one FlowGraph per size)."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=2,
                                     n_positions=32, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config).eval()
    graphs = []

    def backend(gm, inputs):
        graphs.append(gm)
        return kiln.torch.kiln_backend(gm, inputs)

    compiled = torch.compile(model, backend=backend)
    for length in (5, 8, 11):
        ids = torch.randint(0, 64, (2, length))
        with torch.no_grad():
            torch.testing.assert_close(compiled(ids, use_cache=False).logits,
                                       model(ids, use_cache=False).logits, atol=1e-4, rtol=1e-4)
    assert len(graphs) == 2                      # the static graph, then one with SymInts
    dynamic = graphs[-1]
    assert any(isinstance(n.meta.get("example_value"), torch.SymInt) for n in dynamic.graph.nodes)
    assert Interpreter(dynamic).unmapped() == []


def test_shape_arithmetic_with_dynamic_true():
    def fn(x):
        b, t, c = x.size()
        return x.reshape(torch.Size([b * t, c])).sum(0) + torch.sym_max(t, 2)

    compiled = torch.compile(fn, backend="kiln", dynamic=True)
    for shape in ((2, 3, 4), (3, 5, 4)):
        x = torch.randn(shape)
        torch.testing.assert_close(compiled(x), fn(x))


def test_a_rule_returning_the_wrong_shape_or_dtype_is_named():
    def transposed(x):
        return kiln.ops.permute(kiln.ops.silu(x), (1, 0))

    def widened(x):
        return kiln.ops.cast(kiln.ops.silu(x), "float64")

    registry = kiln.torch.mapping_registry()
    for rule, expected in ((transposed, r"float32\[3, 4\].*PyTorch gives float32\[4, 3\]"),
                           (widened, r"float64\[4, 3\].*PyTorch gives float32\[4, 3\]")):
        register_function(F.silu, priority=1000)(rule)
        try:
            torch._dynamo.reset()
            with pytest.raises(RuleResultError, match=rf"rule .*{rule.__name__} for "
                                                      rf"torch.nn.functional.silu \(declared in "
                                                      rf"{__name__}\) returned {expected}"):
                torch.compile(F.silu, backend="kiln")(torch.randn(4, 3))
        finally:
            registry.remove(F.silu, handler=rule)


@pytest.mark.parametrize("fn, dynamic", [(lambda x: F.silu(x, inplace=True) + 1, False),
                                        (lambda x: F.silu(x) + 1, True)], ids=["in-place", "symbolic-sizes"])
def test_a_wrong_shape_is_blamed_on_the_plugin_rule_that_made_it(fn, dynamic, monkeypatch):
    """Issue 30: the result of an in-place call, and one whose sizes are symbols, are checked
    too, so that a plugin rule's wrong shape is neither missed nor blamed on the next node's
    rule (operator.add's, of kiln-mappings-builtin)."""
    def transposed(x, inplace=False):
        return kiln.ops.permute(kiln.ops.silu(x), (1, 0))

    registry = kiln.torch.mapping_registry()
    register_function(F.silu, priority=1000)(transposed)
    try:
        rule, = [r for r in registry.candidates("function", F.silu) if r.handler is transposed]
        monkeypatch.setattr(rule, "plugin", "kiln-test-transposer")    # as for a plugin's rule
        with pytest.raises(RuleResultError, match=r"rule \S*transposed for torch.nn.functional.silu \(plugin "
                                                  r"'kiln-test-transposer'\) returned float32\[3, 4\].*"
                                                  r"PyTorch gives float32\[4, 3\]"):
            torch.compile(fn, backend="kiln", dynamic=dynamic)(torch.randn(4, 3))
    finally:
        registry.remove(F.silu, handler=transposed)


def test_an_in_place_call_keeps_the_dtype_of_the_tensor_it_changes():
    def fn(x, y):
        z = x * 2
        z.add_(y)
        w = x.clone()
        w += y
        return z, w

    x, y = torch.randn(4, 3).half(), torch.randn(4, 3)
    for got, want in zip(torch.compile(fn, backend="kiln")(x, y), fn(x, y)):
        torch.testing.assert_close(got, want)


def test_batch_norm_in_training_mode_says_so():
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3)).train()
    with torch.no_grad(), pytest.raises(MappingError,  # the torch-level path (training: AOT)
                                        match="batch_norm.*training mode .* is not supported"):
        torch.compile(model, backend="kiln")(torch.randn(2, 2, 5, 5))


def test_training_mode_runs_in_pytorch_with_fallback():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3), nn.ReLU()).train()
    reference = nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3), nn.ReLU()).train()
    reference.load_state_dict(model.state_dict())
    kiln.torch.dynamo_config.fallback_to_eager(True)
    x = torch.randn(2, 2, 6, 7)
    with torch.no_grad(), pytest.warns(UserWarning, match="batch_norm"):  # torch-level path
        out = torch.compile(model, backend="kiln")(x)
    torch.testing.assert_close(out, reference(x))
    torch.testing.assert_close(model[1].running_mean, reference[1].running_mean)


def _write_through_select(x):
    y = x[0]
    y.add_(1)
    return x * 1


def _write_through_view(x):
    x.view(-1).mul_(2)
    return x + 0


def _view_read_after_base_changed(x):
    v = x.view(-1)
    x.mul_(2)
    return v + 0


@pytest.mark.parametrize("fn", [_write_through_select, _write_through_view,
                                _view_read_after_base_changed], ids=lambda f: f.__name__)
def test_in_place_changes_through_views_are_never_wrong(fn):
    """Such graphs are functionalized and compiled by Kiln, with no warning; the caller's
    input changes as in eager."""
    x = torch.randn(3, 4)
    eager_x = x.clone()
    expected = fn(eager_x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        actual = torch.compile(fn, backend="kiln")(x)
    assert kiln.torch.KilnFunction.live()
    torch.testing.assert_close(actual, expected)
    torch.testing.assert_close(x, eager_x)


def test_in_place_changes_without_views_still_compile():
    def fn(x, y):
        h = x * 1
        h.add_(y)
        return torch.max(h, 1)[0].relu_() + h.view(-1).sum()

    x, y = torch.randn(3, 4), torch.randn(4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(torch.compile(fn, backend="kiln")(x, y), fn(x, y))


def test_a_declined_node_is_named_with_the_way_to_run_it_in_pytorch():
    def fn(x):
        return F.interpolate(x, scale_factor=2, mode="bicubic", antialias=True) + 1

    with pytest.raises(MappingError, match="(?s)interpolate.*bicubic.*fallback_to_eager"):
        torch.compile(fn, backend="kiln")(torch.randn(1, 2, 4, 5))


def test_view_mutations_are_found_in_symbolically_traced_graphs():
    from kiln.frontend.torch.aliasing import view_mutations

    gm = torch.fx.symbolic_trace(_write_through_select)
    assert len(view_mutations(gm)) == 1
    assert view_mutations(torch.fx.symbolic_trace(lambda x: x.add_(1).view(-1) * 2)) == []


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_parameters_given_new_memory_are_read_from_it(device):
    """Constants are keyed by their memory on every call: `p.data = ...` (same Parameter, new
    storage) and in-place updates must both show in the next result (on CUDA, where the
    addresses are checked by torch's C++ helper, through a captured CUDA graph)."""
    torch._dynamo.reset()
    model = nn.Sequential(nn.Linear(12, 7), nn.ReLU(), nn.Linear(7, 5)).eval().to(device)
    compiled = torch.compile(model, backend="kiln")
    x = torch.randn(3, 12, device=device)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))
        model[0].weight.data = torch.randn(7, 12, device=device)
        torch.testing.assert_close(compiled(x), model(x))
        model[2].bias.add_(1.5)
        torch.testing.assert_close(compiled(x), model(x))


def test_weights_folded_into_constants_follow_in_place_updates():
    """Merged Q/K/V weights and batch norm folded into a convolution are constants computed at
    compile time: an in-place update of the parameters they came from must not leave them
    stale."""
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)
            self.q, self.k = nn.Linear(4, 5), nn.Linear(4, 5)

        def forward(self, x):
            h = self.bn(self.conv(x)).mean((2, 3))
            return self.q(h) * self.k(h)

    model = Block().eval()
    compiled = torch.compile(model, backend="kiln")
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))
        model.k.weight.mul_(-2)
        model.bn.running_mean.add_(0.5)
        torch.testing.assert_close(compiled(x), model(x))
        model.load_state_dict({k: torch.randn_like(v) if v.is_floating_point() else v
                               for k, v in model.state_dict().items()})
        model.bn.running_var.abs_()
        torch.testing.assert_close(compiled(x), model(x))


def test_greedy_decoding_with_a_static_kv_cache_builds_once():
    """A decode loop over transformers' StaticCache (the cache updated in place at
    `cache_position`): one compiled graph serves every step, and the tokens are eager's."""
    from kiln.frontend.torch.backend import KilnFunction
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=50,
                                      max_position_embeddings=32)
    model = transformers.LlamaForCausalLM(config).eval()
    prompt = torch.randint(0, 50, (1, 5))

    def decode(step, steps=10):
        cache = transformers.StaticCache(config=config, max_batch_size=1, max_cache_len=24,
                                         dtype=torch.float32)
        logits = model(prompt, past_key_values=cache, cache_position=torch.arange(5)).logits
        tokens = [logits[:, -1:].argmax(-1)]
        for i in range(steps):
            logits = step(tokens[-1], past_key_values=cache, cache_position=torch.tensor([5 + i])).logits
            tokens.append(logits[:, -1:].argmax(-1))
        return [t.item() for t in tokens]

    before = set(map(id, KilnFunction.live()))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        want = decode(model)
        assert decode(torch.compile(model, backend="kiln")) == want
    compiled = [f for f in KilnFunction.live() if id(f) not in before and f.graphs]
    assert [len(f.graphs) for f in compiled] == [1]


def test_buffers_the_model_changes_itself_do_not_retrace(monkeypatch):
    """A buffer the forward pass updates in place (a running count, a KV cache registered on the
    module) is written back by Kiln; that write must not count as a user's change of the
    constants, or every call would trace and build the graph again."""
    from kiln.frontend.torch.backend import KilnFunction

    class Counter(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 4)
            self.register_buffer("calls", torch.zeros(4))

        def forward(self, x):
            self.calls.add_(1)
            return self.linear(x) + self.calls

    traces = []
    original = KilnFunction._compile
    monkeypatch.setattr(KilnFunction, "_compile", lambda self, args: traces.append(1) or original(self, args))
    model, eager = Counter().eval(), Counter().eval()
    eager.load_state_dict(model.state_dict())
    compiled = torch.compile(model, backend="kiln")
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(2, 4)
            torch.testing.assert_close(compiled(x), eager(x))
    torch.testing.assert_close(model.calls, eager.calls)
    assert len(traces) == 1


def _experts(x):
    """Mixture-of-experts code before a graph break: a zero buffer the caller fills in place."""
    return torch.zeros_like(x), torch.arange(4.0) * 2, x + 1


def test_outputs_known_when_compiling_are_new_tensors_at_each_call():
    """Before: a graph output Kiln knew when compiling (zeros, a range) was one tensor returned
    by every call; Switch Transformers' experts add into their `torch.zeros_like` output after
    a graph break, so every later layer started from the last one's sums (silently wrong)."""
    compiled = torch.compile(_experts, backend="kiln")
    x = torch.randn(3, 4)
    zeros, steps, _ = compiled(x)
    zeros.add_(5)
    steps.mul_(0)
    again, steps_again, _ = compiled(x)
    assert torch.equal(again, torch.zeros(3, 4)) and torch.equal(steps_again, torch.arange(4.0) * 2)
    assert again.data_ptr() != zeros.data_ptr()


def test_parameters_returned_are_the_callers_own():
    """A parameter the graph returns is handed out as itself, as eager does (not a copy)."""
    lin = nn.Linear(3, 2)
    weight = torch.compile(lambda x: (lin.weight, lin(x)), backend="kiln")(torch.randn(4, 3))[0]
    assert weight.data_ptr() == lin.weight.data_ptr()


class _RouterToItsDtype(nn.Module):
    """Switch Transformers' router: `self.classifier = self.classifier.to(self.dtype)` in the
    forward, which dynamo records as `Tensor.set_` of each parameter and a version-counter
    helper."""

    def __init__(self):
        super().__init__()
        self.classifier = nn.Linear(4, 3)

    def forward(self, x):
        self.classifier = self.classifier.to(torch.float32)
        return self.classifier(x).softmax(-1)


def test_module_to_its_own_dtype_in_forward_compiles():
    """Before: unmapped (`torch.Tensor.set_`, `_lower_version_count_by_1`)."""
    torch.manual_seed(0)
    model, x = _RouterToItsDtype(), torch.randn(5, 4)
    with torch.no_grad():
        got = torch.compile(model, backend="kiln", fullgraph=True)(x)
        torch.testing.assert_close(got, model(x))
    assert model.classifier.weight.dtype == torch.float32
