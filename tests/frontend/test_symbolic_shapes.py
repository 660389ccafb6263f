"""Symbolic shapes through torch.compile, on the CPU: a graph dynamo traced with symbolic sizes
runs at every size with the kernels built for the first (counted as CPU kernel cache misses in
a fresh cache, from the `kiln` log), and matches eager. (The CUDA programs that
KILN_NVRTC_CHECK compiles for each task are left out here: tests/cuda checks those.)"""
import gc
import sys
import warnings

import pytest
import torch
import transformers
from torch import nn

import kiln
from kiln.frontend.torch.backend import SIGNATURES_KEPT, KilnFunction
from kiln.runtime.backend import BACKENDS
from tests.frontend.frontend_support import builds_per_length, fresh_compiles, greedy_decode, kernels_built


@pytest.fixture(autouse=True)
def fresh(tmp_path, monkeypatch):
    yield from fresh_compiles(tmp_path, monkeypatch)


@pytest.fixture
def builds(caplog):
    """The number of CPU kernels built so far."""
    built = kernels_built(caplog, "cpu")
    return lambda: len(built())


def _gpt2(n_layer=1, n_positions=32):
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_embd=16, n_layer=n_layer, n_head=2,
                                     n_positions=n_positions, bos_token_id=0, eos_token_id=0)
    return config, transformers.GPT2LMHeadModel(config).eval()


def test_tiny_gpt2_builds_its_kernels_once_for_five_sequence_lengths(builds):
    _, model = _gpt2()
    new = builds_per_length(model, (5, 8, 11, 13, 30), builds)
    assert new[0] > 0 and new[1:] == [0, 0, 0, 0]


def test_a_decode_loop_with_a_growing_kv_cache_builds_kernels_once(builds):
    """32 greedy tokens over transformers' DynamicCache: the prompt and the first step are
    static graphs, dynamo's second step makes the cache length symbolic; from then on no step
    builds a kernel, and the tokens are eager's."""
    config, model = _gpt2(n_layer=2, n_positions=64)
    prompt = torch.randint(0, 64, (1, 5))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want, _ = greedy_decode(model, prompt, config, builds)
        got, new = greedy_decode(torch.compile(model, backend="kiln"), prompt, config, builds)
    assert got == want
    assert new[1] > 0 and new[2:] == [0] * 30


def test_dynamic_true_cnn_builds_once_for_three_batch_sizes(builds):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Conv2d(8, 16, 3, stride=2), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(16, 5)).eval()
    model[1].running_mean.uniform_(-1, 1)
    compiled = torch.compile(model, backend="kiln", dynamic=True)
    new = []
    for batch in (4, 7, 2):
        x = torch.randn(batch, 3, 17, 19)
        before = builds()
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), model(x), atol=1e-4, rtol=1e-4)
        new.append(builds() - before)
    assert new[0] > 0 and new[1:] == [0, 0]


def test_only_the_last_signatures_are_kept():
    compiled = torch.compile(lambda x: (x * 2).sum(-1), backend="kiln", dynamic=True)
    before = set(map(id, KilnFunction.live()))
    for n in range(2, SIGNATURES_KEPT + 4):
        x = torch.randn(3, n)
        torch.testing.assert_close(compiled(x), (x * 2).sum(-1))
    function, = [f for f in KilnFunction.live() if id(f) not in before and f.graphs]
    shapes = [next(s[0] for s in key if isinstance(s, tuple)) for key in function.graphs]
    assert shapes == [(3, n) for n in range(4, SIGNATURES_KEPT + 4)]


def test_a_new_size_at_every_call_keeps_what_the_process_holds_bounded(monkeypatch):
    """One function called at 200 widths (issue 30): the Tasks of each operator, the fused
    groups' Tasks and the kernels kept for reuse stay within their bounds (made small here), the loaded kernels are
    those still used (the graphs of the last SIGNATURES_KEPT sizes and the kernels kept), and
    every size, old or kept, still runs."""
    operators = sys.modules["kiln.graph.operator"]
    monkeypatch.setattr(operators, "TASKS_KEPT", 8)
    monkeypatch.setattr(operators, "KERNELS_KEPT", 8)
    groups = sys.modules["kiln.passes.fused"]
    monkeypatch.setattr(groups, "GROUPS_KEPT", 8)
    fn = lambda x: torch.relu(x) * 2 + 1
    compiled = torch.compile(fn, backend="kiln", dynamic=True)
    before = set(map(id, KilnFunction.live()))
    loaded = BACKENDS["cpu"]._loaded
    gc.collect()
    loaded_before = len(loaded)
    definitions = {name: c.item for name, c in kiln.plugins.registry().operators.items()}
    tasks_before = {name: len(d._tasks) for name, d in definitions.items()}
    # a trace at symbolic sizes fills caches of its own (`kiln.ir.size_reads`), and a size that
    # runs another's plan fills none: what earlier tests left stays until the next put
    kept_before = max(8, len(operators._compiled)), max(8, len(groups._composed))
    for n in range(2, 202):
        x = torch.randn(3, n)
        torch.testing.assert_close(compiled(x), fn(x))
    gc.collect()
    function, = [f for f in KilnFunction.live() if id(f) not in before and f.graphs]
    used = {id(step.kernel.kernel) for run in function.graphs.values() for step in run.compiled.steps}
    assert len(function.graphs) == SIGNATURES_KEPT
    assert len(operators._compiled) <= kept_before[0] and len(groups._composed) <= kept_before[1]
    tasks = {name: len(d._tasks) for name, d in definitions.items() if len(d._tasks) != tasks_before[name]}
    assert all(n <= 8 for n in tasks.values()), tasks
    assert len(loaded) - loaded_before <= SIGNATURES_KEPT + 8
    assert used <= {id(kernel) for kernel in loaded.values()}
    for n in (2, 201, 100):
        x = torch.randn(3, n)
        torch.testing.assert_close(compiled(x), fn(x))


def test_a_float_the_graph_reads_is_part_of_its_signature():
    """dynamic=True passes batch norm's eps as a one-element tensor that the graph reads with
    `.item()`: a call with another value must not run the graph traced with the first."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)).eval()
    model[1].running_var.uniform_(0.01, 0.02)
    captured = []

    def backend(gm, inputs):
        captured.append((gm, list(inputs)))
        return kiln.torch.kiln_backend(gm, inputs)

    x = torch.randn(2, 3, 9, 10)
    with torch.no_grad():
        torch.compile(model, backend=backend, dynamic=True)(x)
        gm, inputs = captured[-1]
        function = kiln.torch.kiln_backend(gm, inputs)
        eps, = [k for k, n in enumerate(gm.graph.find_nodes(op="placeholder"))
                if any(u.target == "item" for u in n.users) and "eps" in n.name]
        for value in (1e-5, 0.5):
            inputs[eps] = torch.tensor(value, dtype=torch.float64)
            model[1].eps = value
            torch.testing.assert_close(function(*inputs)[0], model(x), atol=1e-4, rtol=1e-4)


def test_graphs_are_told_apart_by_the_inputs_of_symbolic_sizes_only():
    """A call's graph is looked up by the inputs whose sizes are symbolic (and the sizes passed
    as integers); dynamo's guards fix every other input's shape, dtype and device, so they are
    not read at each call. Each size still gets its own graph, with eager's values."""
    earlier = list(KilnFunction.live())     # held, so no new function takes an earlier one's id
    weight = torch.randn(3)
    f = torch.compile(lambda x, w: (x * w + 1).sum(-1), backend="kiln")
    x = torch.randn(5, 3)
    torch.testing.assert_close(f(x, weight), (x * weight + 1).sum(-1))
    [fixed] = [g for g in KilnFunction.live() if g not in earlier and g.graphs]
    assert fixed._keyed_positions == [] and fixed._input_positions
    for rows in (7, 2, 9):
        x = torch.randn(rows, 3)
        torch.testing.assert_close(f(x, weight), (x * weight + 1).sum(-1))
    [symbolic] = [g for g in KilnFunction.live() if g not in earlier and g is not fixed and g.graphs]
    placeholders = [n for n in symbolic.gm.graph.nodes if n.op == "placeholder"]
    weights = [k for k, n in enumerate(placeholders)
               if isinstance(n.meta.get("example_value"), torch.Tensor) and n.meta["example_value"].dim() == 1]
    assert weights and not set(weights) & set(symbolic._keyed_positions)
    assert set(symbolic._keyed_positions) | set(weights) == set(symbolic._input_positions)
    assert len(symbolic.graphs) == 3


def test_a_graph_compiled_outside_torch_compile_is_told_apart_by_every_input():
    """Without dynamo's guards (the backend called on a graph of make_fx), a call at other sizes
    is traced again, not run by the kernels built for the first sizes: make_fx fixed the graph's
    sizes, so it raises, naming the rule and both shapes."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from kiln.frontend.torch.interpreter import RuleResultError
    f = lambda x, w: (x * w + 1).sum(-1)
    x, weight = torch.randn(5, 3), torch.randn(3)
    function = kiln.torch.kiln_backend(make_fx(f)(x, weight), [x, weight])
    torch.testing.assert_close(function(x, weight), f(x, weight))
    with pytest.raises(RuleResultError, match=r"float32\[8, 3\].*float32\[5, 3\]"):
        function(torch.randn(8, 3), weight)
