"""The whole-graph cache: a hit gives a fresh compile's outputs, skips mapping, passes and builds,
and never serves a plan compiled for another graph, other inputs, settings, code or (where the
compile read them) constant values."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from torch import nn

import kiln
from kiln.frontend.torch import graph_key, registry as mapping_rules, run_record
from kiln.passes import PassContext, PassTiming
from kiln import plugins
from kiln.plugins import PluginInfo, registry

from frontend_support import Capture


@pytest.fixture
def graph_cache(tmp_path, monkeypatch, caplog):
    """The graph cache on, over an empty cache of the test's own; the mapping rules the
    plugins' alone (rules other test modules declared would turn the cache off); the `kiln`
    logger's info records captured; dynamo and dynamo_config reset around the test."""
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("KILN_GRAPH_CACHE", "1")
    monkeypatch.delenv("KILN_NVRTC_CHECK", raising=False)
    monkeypatch.setattr(mapping_rules, "_declared", [])
    monkeypatch.setattr(mapping_rules, "_live", None)
    caplog.set_level(logging.INFO, logger="kiln")
    torch._dynamo.reset()
    yield tmp_path / "cache"
    kiln.torch.dynamo_config.reset()
    torch._dynamo.reset()


def events(caplog) -> list[str]:
    """'hit', 'miss' or 'not keyed' for each compile that asked the graph cache or could not,
    in order."""
    found = []
    for record in caplog.records:
        message = record.getMessage()
        for event, prefix in (("hit", "graph cache hit"), ("miss", "graph cache miss"),
                              ("not keyed", "graph not keyed")):
            if message.startswith(prefix):
                found.append(event)
    return found


def messages(caplog, prefix: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith(prefix)]


def compiled(model, *inputs, **options):
    """The first call of `model` compiled afresh by Kiln (dynamo reset: a new KilnFunction)."""
    torch._dynamo.reset()
    with torch.no_grad():
        return torch.compile(model, backend="kiln", options=options or None)(*inputs)


class ConvNet(nn.Module):
    """A convolution whose batch norm the passes fold into it, then a linear head."""

    def __init__(self, hidden: int = 6):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)
        self.head = nn.Linear(4 * 4 * 4, hidden)
        self.bn.running_mean.uniform_(-0.5, 0.5)
        self.bn.running_var.uniform_(0.5, 1.5)

    def forward(self, x):
        return self.head(torch.relu(self.bn(self.conv(x))).flatten(1))


class Mlp(nn.Module):
    def __init__(self, hidden: int = 5, activation=torch.relu):
        super().__init__()
        self.up, self.down = nn.Linear(6, hidden), nn.Linear(hidden, 3)
        self.activation = activation

    def forward(self, x):
        return self.down(self.activation(self.up(x)))


def test_a_hit_skips_mapping_passes_and_builds_and_gives_a_fresh_compiles_outputs(graph_cache, caplog):
    torch.manual_seed(0)
    model, x = ConvNet().eval(), torch.randn(2, 3, 6, 6)
    fresh = compiled(model, x)
    assert events(caplog) == ["miss"]
    stages = len(messages(caplog, "stage "))
    hit = compiled(model, x)
    assert events(caplog) == ["miss", "hit"]
    later = [m.split(":")[0] for m in messages(caplog, "stage ")[stages:]]
    assert later == ["stage graph cache"]                 # no interpret, optimize or build stage
    assert torch.equal(hit, fresh)
    torch.testing.assert_close(hit, model(x), atol=1e-4, rtol=1e-4)
    uncached = compiled(model, x, graph_cache=False)
    assert torch.equal(hit, uncached)


CHANGES = ["the graph", "a constant's shape", "an input's strides", "a dtype", "a setting", "a KILN_ variable",
           "the pass context", "a plugin's version", "a plugin added"]


@pytest.mark.parametrize("change", CHANGES)
def test_changing_one_part_of_the_key_misses(change, graph_cache, caplog, monkeypatch):
    torch.manual_seed(0)
    model, x, options = Mlp().eval(), torch.randn(4, 6), {}
    compiled(model, x)
    compiled(model, x)
    assert events(caplog) == ["miss", "hit"]
    if change == "the graph":
        model.activation = torch.tanh
    elif change == "a constant's shape":
        model = Mlp(hidden=7).eval()
    elif change == "an input's strides":
        x = torch.randn(6, 4).t()
    elif change == "a dtype":
        model, x = model.double(), x.double()
    elif change == "a setting":
        options = {"allow_tf32": True}
    elif change == "a KILN_ variable":
        monkeypatch.setenv("KILN_DEPENDENT_LAUNCH", "0")
    elif change == "a plugin's version":
        found = [(ep, replace(info, version=info.version + ".post1") if info.distribution == "kiln-ops-builtin"
                  else info) for ep, info in plugins.installed()]
        monkeypatch.setattr(plugins, "installed", lambda: found)
        monkeypatch.setattr(graph_key, "_code_digests", None)     # as in a process that starts now
    elif change == "a plugin added":
        loaded = registry()
        monkeypatch.setattr(loaded, "plugins", [*loaded.plugins, PluginInfo("extra", "kiln-extra", "1.0")])
    if change == "the pass context":
        with PassContext(disabled_passes=["fuse_operators"]):
            out = compiled(model, x)
    else:
        out = compiled(model, x, **options)
    assert events(caplog)[-1] == "miss"
    torch.testing.assert_close(out, model(x), atol=1e-4, rtol=1e-4)


def test_a_model_with_other_weights_hits_and_computes_with_its_own(graph_cache, caplog):
    torch.manual_seed(0)
    model, other, x = Mlp().eval(), Mlp().eval(), torch.randn(4, 6)
    compiled(model, x)
    out = compiled(other, x)
    assert events(caplog) == ["miss", "hit"]
    torch.testing.assert_close(out, other(x), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out, model(x))


def test_constants_folded_at_compile_time_are_keyed_by_their_values(graph_cache, caplog):
    torch.manual_seed(0)
    model, x = ConvNet().eval(), torch.randn(2, 3, 6, 6)
    compiled(model, x)
    with torch.no_grad():
        model.bn.running_var.mul_(2.0)       # folded into the convolution's weights
    out = compiled(model, x)
    assert events(caplog) == ["miss", "miss"]
    assert "other values of constants" in messages(caplog, "graph cache miss")[-1]
    torch.testing.assert_close(out, model(x), atol=1e-4, rtol=1e-4)
    compiled(model, x)
    assert events(caplog)[-1] == "hit"       # the entry now holds the new values' plan


class Projections(nn.Module):
    """Three linear layers reading one input: the passes merge them into one over their
    weights concatenated at compile time."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(8, 8), nn.Linear(8, 4), nn.Linear(8, 4)

    def forward(self, x):
        return self.q(x) * torch.cat([self.k(x), self.v(x)], -1)


def test_weights_concatenated_at_compile_time_are_computed_again_from_the_callers_on_a_hit(graph_cache, caplog):
    torch.manual_seed(0)
    model, other, x = Projections().eval(), Projections().eval(), torch.randn(3, 8)
    compiled(model, x)
    out = compiled(other, x)
    assert events(caplog) == ["miss", "hit"]
    torch.testing.assert_close(out, other(x), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out, model(x))
    (path,) = (graph_cache / "graphs").rglob("*.plan")
    entry = run_record.loads(path.read_bytes())
    assert entry["run"].read == [] and entry["folds"] is not None
    stored = [*entry["run"].plan.constants.values()]
    assert not [t for t in stored if t.shape[0] == 16]         # the concatenated weight is not stored


class ScaledAttention(nn.Module):
    """Attention scaled by a one-element buffer, which the attention pattern reads and folds
    into the fused operator's `scale` attribute (a constant's value in the code)."""

    def __init__(self, scale: float):
        super().__init__()
        self.register_buffer("scale", torch.tensor([scale]))

    def forward(self, q, k, v):
        return torch.softmax(q @ k.transpose(-1, -2) * self.scale, -1) @ v


def test_a_constant_folded_into_the_code_is_keyed_by_its_value(graph_cache, caplog):
    q, k, v = (torch.randn(2, 8, 16) for _ in range(3))
    capture = Capture()
    with torch.no_grad():
        torch.compile(ScaledAttention(0.5), backend=capture)(q, k, v)
    (run,) = capture.compiled[0].graphs.values()
    assert [n.attrs.get("scale") for n in run.graph.nodes if "attention" in n.definition.name] == [0.5]
    model = ScaledAttention(0.25)
    out = compiled(model, q, k, v)
    assert events(caplog) == ["miss", "miss"]
    assert "other values of constants" in messages(caplog, "graph cache miss")[-1]
    torch.testing.assert_close(out, model(q, k, v), atol=1e-5, rtol=1e-5)


def test_graphs_with_symbolic_sizes_hit_at_each_size(graph_cache, caplog):
    torch.manual_seed(0)
    model = Mlp().eval()
    inputs = [torch.randn(n, 6) for n in (3, 5)]
    for _ in range(2):
        torch._dynamo.reset()
        function = torch.compile(model, backend="kiln", dynamic=True)
        with torch.no_grad():
            for x in inputs:
                torch.testing.assert_close(function(x), model(x), atol=1e-5, rtol=1e-5)
    # the second size runs the first's plan (`plan_reuse`), stored for the later process
    assert events(caplog) == ["miss", "hit", "hit"]


@pytest.mark.parametrize("off", ["KILN_GRAPH_CACHE=0", "dynamo_config", "options"])
def test_the_cache_can_be_turned_off(off, graph_cache, caplog, monkeypatch):
    torch.manual_seed(0)
    model, x = Mlp().eval(), torch.randn(4, 6)
    options = {}
    if off == "KILN_GRAPH_CACHE=0":
        monkeypatch.setenv("KILN_GRAPH_CACHE", "0")
    elif off == "dynamo_config":
        kiln.torch.dynamo_config.graph_cache(False)
    else:
        options = {"graph_cache": False}
    for _ in range(2):
        torch.testing.assert_close(compiled(model, x, **options), model(x), atol=1e-5, rtol=1e-5)
    assert events(caplog) == [] and not (graph_cache / "graphs").exists()


def test_what_the_key_cannot_describe_compiles_uncached(graph_cache, caplog):
    torch.manual_seed(0)
    model, x = Mlp().eval(), torch.randn(4, 6)
    with PassContext(instruments=[PassTiming()]):
        compiled(model, x)

    @kiln.torch.register_function(torch.nn.functional.silu)
    def silu(x, inplace=False):
        return x * kiln.ops.sigmoid(x)

    compiled(model, x)
    reasons = messages(caplog, "graph not keyed")
    assert events(caplog) == ["not keyed", "not keyed"]
    assert "instruments" in reasons[0] and "mapping rules declared outside a plugin" in reasons[1]


def test_training_graphs_hit_and_give_the_same_gradients(graph_cache, caplog):
    torch.manual_seed(0)
    model, x = Mlp(), torch.randn(4, 6)
    grads = []
    for _ in range(2):
        torch._dynamo.reset()
        model.zero_grad()
        torch.compile(model, backend="kiln")(x).square().sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert events(caplog) == ["miss", "miss", "hit", "hit"]      # forward, backward, twice
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_the_cache_keeps_within_its_limit(graph_cache, caplog, monkeypatch):
    monkeypatch.setenv("KILN_GRAPH_CACHE_MB", "0")
    torch.manual_seed(0)
    model, x = Mlp().eval(), torch.randn(4, 6)
    compiled(model, x)
    compiled(model, x)
    assert events(caplog) == ["miss", "miss"]
    assert not list((graph_cache / "graphs").rglob("*.plan"))


COMPILE = """
import sys, torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                      nn.Linear(4 * 4 * 4, 5)).eval()
x = torch.randn(2, 3, 6, 6)
with torch.no_grad():
    torch.save(torch.compile(model, backend="kiln")(x), sys.argv[1])
"""


def test_processes_compiling_at_once_then_a_later_one_share_the_cache(tmp_path):
    env = {**os.environ, "KILN_CACHE_DIR": str(tmp_path / "cache"), "KILN_GRAPH_CACHE": "1",
           "KILN_NVRTC_CHECK": "", "KILN_LOG": "info"}

    def start(name):
        return subprocess.Popen([sys.executable, "-c", COMPILE, str(tmp_path / f"{name}.pt")], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    at_once = [start("a"), start("b")]
    logs = [p.communicate(timeout=600)[1] for p in at_once]
    assert [p.returncode for p in at_once] == [0, 0], logs
    assert any("graph cache miss" in log for log in logs)
    later = start("c")
    log = later.communicate(timeout=600)[1]
    assert later.returncode == 0, log
    assert "graph cache hit" in log
    assert "kernel cache miss" not in log and "stage interpret" not in log
    outputs = [torch.load(tmp_path / f"{name}.pt") for name in "abc"]
    assert torch.equal(outputs[0], outputs[1]) and torch.equal(outputs[0], outputs[2])


FRESH_PROCESS = """
import sys, torch
from torch import nn
import kiln.plugins
torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                      nn.Linear(4 * 4 * 4, 5)).eval()
with torch.no_grad():
    model[1].running_var.uniform_(0.5, 1.5)
    model[1].running_var.mul_(float(sys.argv[2]))     # folded into the convolution's weights
x = torch.randn(2, 3, 6, 6)
with torch.no_grad():
    out = torch.compile(model, backend="kiln")(x)
torch.testing.assert_close(out, model(x), atol=1e-4, rtol=1e-4)
torch.save(out, sys.argv[1])
print("plugins loaded:", kiln.plugins.loaded() is not None)
"""


def test_a_hit_in_a_fresh_process_loads_no_plugin_and_a_folded_weights_change_misses(tmp_path):
    env = {**os.environ, "KILN_CACHE_DIR": str(tmp_path / "cache"), "KILN_GRAPH_CACHE": "1",
           "KILN_NVRTC_CHECK": "", "KILN_LOG": "info"}

    def run(name: str, scale: float) -> tuple[str, str]:
        done = subprocess.run([sys.executable, "-c", FRESH_PROCESS, str(tmp_path / f"{name}.pt"), str(scale)],
                              env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr
        return done.stdout, done.stderr

    cold, warm, other = run("cold", 1.0), run("warm", 1.0), run("other", 2.0)
    assert "graph cache miss" in cold[1] and "plugins loaded: True" in cold[0]
    assert "graph cache hit" in warm[1] and "plugins loaded: False" in warm[0]
    assert "stage interpret" not in warm[1]
    assert torch.equal(torch.load(tmp_path / "cold.pt"), torch.load(tmp_path / "warm.pt"))
    assert "other values of constants" in other[1] and "plugins loaded: True" in other[0]
    assert not torch.allclose(torch.load(tmp_path / "cold.pt"), torch.load(tmp_path / "other.pt"))


def test_a_graph_the_cache_lacks_still_lists_its_unmapped_operators_when_compiled(graph_cache):
    def uses_an_unmapped_operator(x):
        return torch.special.zeta(x, x)

    with pytest.raises(Exception, match="UnmappedOperatorError(.|\n)*torch.special.zeta"):
        compiled(uses_an_unmapped_operator, torch.rand(4) + 1.5)


def test_kiln_cache_shows_and_clears_the_graph_cache(graph_cache, capsys):
    from kiln.cli import main
    from kiln.runtime import cache

    torch.manual_seed(0)
    compiled(Mlp().eval(), torch.randn(4, 6))
    cache.write_entry("cpu", "ab" * 32, ".so", b"a kernel")
    capsys.readouterr()
    assert main(["cache", "status"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line.split()[1] for line in lines[2:-1]}
    kernels = cache.status()["kinds"]["cpu"]
    assert rows["graphs"] == "1" and rows["cpu"] == str(kernels["entries"])
    assert lines[-1] == "graph cache (kind graphs): on, at most 1.0 GiB (KILN_GRAPH_CACHE_MB)"
    assert main(["cache", "clear", "--kind", "graphs"]) == 0
    assert capsys.readouterr().out.strip() == f"removed 1 entries of kind graphs from {graph_cache}"
    assert cache.status()["kinds"] == {"cpu": kernels}      # the folder of graphs removed too


def test_the_key_names_a_pybind11_function_a_graph_calls():
    # a Llama-style model on CUDA calls one (autocast's); its record was taken for an argument
    text = graph_key._callable_text(torch._C._accelerator_getAccelerator)
    assert text == f"torch._C.{torch._C._accelerator_getAccelerator.__qualname__}"


def test_the_key_tells_functions_of_one_name_apart_by_code_and_captured_values():
    def scaled(a):
        return lambda x: x * a

    def recursive():
        def again(n):
            return again(n - 1) if n else 0
        return again

    texts = [graph_key._callable_text(f) for f in (scaled(2), scaled(3), scaled(2))]
    assert texts[0] != texts[1] and texts[0] == texts[2]
    assert "closure" in graph_key._callable_text(recursive())     # holds itself: named, not followed


@pytest.mark.cuda
def test_a_hit_on_cuda_replays_as_a_cuda_graph(graph_cache, caplog):
    torch.manual_seed(0)
    model, x = ConvNet().cuda().eval(), torch.randn(2, 3, 6, 6, device="cuda")
    fresh = compiled(model, x)
    hit = compiled(model, x)
    assert events(caplog) == ["miss", "hit"]
    torch.testing.assert_close(hit, fresh)
    with torch.no_grad():
        fn = torch.compile(model, backend="kiln")
        for _ in range(3):                      # replays of the capture made from the cached plan
            y = torch.randn(2, 3, 6, 6, device="cuda")
            torch.testing.assert_close(fn(y), model(y), atol=1e-4, rtol=1e-4)


@pytest.mark.cuda
def test_a_training_step_on_cuda_from_the_cache(graph_cache, caplog):
    """Forward and backward plans from the cache, their CUDA graphs lending and binding the
    saved values, and a CPU scalar argument moved to the GPU, as a fresh compile does."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    model = Mlp(hidden=32, activation=torch.tanh).cuda()

    def step(fn, x, scale):
        model.zero_grad()
        loss = (fn(x) * scale).square().mean()
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    x, scale = torch.randn(16, 6, device="cuda"), torch.tensor(0.5)
    want = step(model, x, scale)
    for _ in range(2):
        torch._dynamo.reset()
        fn = torch.compile(lambda x, s: model(x) * s, backend="kiln")
        for _ in range(2):
            loss, grads = step(lambda x: fn(x, scale), x, 1.0)
            torch.testing.assert_close(loss, want[0], atol=1e-5, rtol=1e-5)
            for got, expected in zip(grads, want[1]):
                torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert events(caplog).count("hit") >= 2


def test_the_read_constants_hashed_at_once_on_threads_hash_as_one_by_one(monkeypatch):
    from kiln.frontend.torch import graph_cache
    from kiln.runtime import threads

    args = [torch.randn(40, 30), 3, torch.randn(7), torch.randn(5, 5).t()]
    one_by_one = [graph_key.tensor_digest(args[k]) for k in (3, 0, 2)]
    monkeypatch.setattr(threads, "AT_ONCE", 0)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    assert graph_cache._values_digest(args, [3, 0, 2]) == one_by_one


def test_memory_of_a_graph_the_cache_served_names_it(graph_cache, caplog):
    """Before: `kiln.frontend.torch.memory.graph_memory` of a function whose plan came from this
    cache failed with "'NoneType' object has no attribute 'compile'" (train_memory.py on a GPU,
    after another run had filled the cache); now it says which graph and how to count it."""
    from kiln.frontend.torch import KilnFunction
    from kiln.frontend.torch.memory import graph_memory
    model, x = nn.Linear(8, 4), torch.randn(3, 8)
    compiled(model, x)                                  # stores the plan
    before = set(KilnFunction.live())
    compiled(model, x)                                  # served by the cache
    assert events(caplog) == ["miss", "hit"]
    served = [f for f in KilnFunction.live() if f not in before]
    assert served
    with pytest.raises(ValueError, match="whole-graph cache"):
        for function in served:
            graph_memory(function)

