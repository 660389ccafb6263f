"""The mapping registry: priorities, checks that decline, stacked decorators, aliases, and the
backend's registration as a torch.compile entry point."""
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.frontend.torch import MappingRegistry, Rule, mapping_registry, register_function, rules_of
from kiln.frontend.torch.config import DynamoConfig

from frontend_support import Capture, compile_and_compare


def target(x):
    return x


def test_priority_then_latest_declaration_wins_and_checks_decline():
    registry = MappingRegistry()
    low = Rule("function", target, lambda x: "low", priority=0)
    high = Rule("function", target, lambda x: "high", priority=5, check=lambda x: x > 0)
    later_low = Rule("function", target, lambda x: "later low", priority=0)
    for rule in (low, high, later_low):
        registry.add(rule)
    assert registry.resolve("function", target, (1,), {}) is high
    assert registry.resolve("function", target, (-1,), {}) is later_low
    assert registry.remove(target) == [high, later_low, low]
    assert registry.resolve("function", target, (1,), {}) is None


def test_ties_between_plugins_are_reported():
    registry = MappingRegistry()
    registry.add(Rule("function", target, target, plugin="a"))
    registry.add(Rule("function", target, target, plugin="b"))
    assert registry.ties() == [("function", target, ["a", "b"])]


def test_stacked_decorators_and_aliases_share_one_handler():
    @register_function(torch.special.expit)
    @register_function(torch.special.logit, torch.special.log_ndtr, priority=-100)
    def handler(x):
        return x

    try:
        registry = mapping_registry()
        for t in (torch.special.expit, torch.special.logit, torch.special.log_ndtr):
            assert any(r.handler is handler for r in registry.candidates("function", t))
        assert {r.name for r in rules_of(sys.modules[__name__])} >= {"torch.special.expit"}
    finally:
        for t in (torch.special.expit, torch.special.logit, torch.special.log_ndtr):
            mapping_registry().remove(t, handler=handler)


def test_a_higher_priority_rule_that_declines_falls_back_to_the_builtin_one():
    used = []

    def wide_only(input):
        return input.ndim == 2

    @register_function(torch.tanh, priority=10, check=wide_only)
    def tanh_2d(input):
        used.append(input.shape)
        return kiln.ops.tanh(input)

    try:
        compile_and_compare(torch.tanh, torch.randn(3, 4))
        compile_and_compare(torch.tanh, torch.randn(5))
        assert used == [(3, 4)]
    finally:
        mapping_registry().remove(torch.tanh, handler=tanh_2d)


def test_a_rule_names_a_library_operator_it_does_not_import():
    """A rule may name a `torch.ops` operator by its name before the library defining it is
    loaded; it then maps the operator's packet (dynamo's graphs) and its overload (AOTAutograd's)."""
    @register_function("kilntest.twice_plus", "kilntest.twice_plus.default")
    def twice_plus(x, y):
        return kiln.ops.add(kiln.ops.mul(x, 2), y)

    try:
        library = torch.library.Library("kilntest", "FRAGMENT")
        library.define("twice_plus(Tensor x, Tensor y) -> Tensor")
        library.impl("twice_plus", lambda x, y: x * 2 + y, "CompositeExplicitAutograd")
        library.impl("twice_plus", lambda x, y: torch.empty_like(x), "Meta")
        op = torch.ops.kilntest.twice_plus
        registry = mapping_registry()
        assert registry.has("function", op) and registry.has("function", op.default)
        assert registry.candidates("function", op)[0].name == "kilntest.twice_plus"
        capture, _ = compile_and_compare(lambda x, y: op(x, y).relu(), torch.randn(3, 4), torch.randn(3, 4))
        assert capture.compiled
    finally:
        for name in ("kilntest.twice_plus", "kilntest.twice_plus.default"):
            mapping_registry().remove(name, handler=twice_plus)


def test_builtin_rules_come_from_the_plugin_entry_point():
    plugins = {r.plugin for r in mapping_registry().candidates("function", F.relu)}
    assert "kiln-mappings-builtin" in plugins


def test_backend_is_found_by_entry_point_without_import_kiln():
    code = ("import sys, torch\n"
            "f = torch.compile(lambda x: torch.relu(x) + 1, backend='kiln')\n"
            "y = f(torch.tensor([-1.0, 2.0]))\n"
            "from torch._dynamo import lookup_backend\n"
            "from kiln.frontend.torch import kiln_backend\n"
            "assert lookup_backend('kiln') is kiln_backend\n"
            "print(y.tolist())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[1.0, 3.0]"


def test_modes_and_options():
    config = DynamoConfig()
    assert config.resolve({"mode": "max-autotune"}).search_space == 2
    assert not config.resolve({"mode": "max-autotune-no-cudagraphs"}).use_cuda_graph
    assert config.resolve({"mode": "reduce-overhead"}).use_cuda_graph
    assert config.resolve({"use_fp16": True}).use_fp16
    with pytest.raises(ValueError, match="does not know option"):
        config.resolve({"fast": True})
    with pytest.raises(ValueError, match="does not know mode"):
        config.resolve({"mode": "turbo"})
    capture = Capture(mode="max-autotune")
    torch._dynamo.reset()
    torch.compile(torch.sin, backend=capture)(torch.randn(3))
    assert capture.compiled[0].settings.search_space == 2
    torch._dynamo.reset()
    y = torch.compile(torch.cos, backend="kiln", mode="max-autotune")(torch.zeros(2))
    torch.testing.assert_close(y, torch.ones(2))
