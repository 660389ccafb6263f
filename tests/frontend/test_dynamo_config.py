"""kiln.torch.dynamo_config: the correctness report, the input graph table, float16, and the
settings' validation."""
import pytest
import torch
from torch import nn

import kiln
from kiln.frontend.torch.report import node_error

from frontend_support import compile_and_compare


@pytest.fixture
def config():
    yield kiln.torch.dynamo_config
    kiln.torch.dynamo_config.reset()


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).eval()


def test_kiln_torch_is_the_frontend():
    import kiln.frontend.torch as frontend
    assert kiln.torch is frontend
    assert kiln.torch.dynamo_config is frontend.dynamo_config


def test_node_error_is_the_harmonic_mean_of_absolute_and_relative_error():
    expected = torch.tensor([0.0, 3.0])
    assert node_error(torch.tensor([0.5, 3.0]), expected) == pytest.approx(1.0)  # 2*0.5/(1+0)
    assert node_error(torch.tensor([0.0, 3.4]), expected) == pytest.approx(0.2)  # 2*0.4/(1+3)
    assert node_error(3, 3) is None


def _tables(out: str) -> tuple[list[list[str]], list[list[str]]]:
    """The rows (split into cells) of the report's fx-node table and kernel table."""
    nodes, kernels = out.split("kernels that run")
    return ([line.split() for line in nodes.strip().splitlines()[3:]],
            [line.split() for line in kernels.strip().splitlines()[3:]])


def test_correctness_report_prints_one_row_per_node_and_kernel(config, capsys):
    config.correctness_report()
    compile_and_compare(_model(), torch.randn(2, 4))
    out = capsys.readouterr().out
    assert out.splitlines()[1].split() == ["kind", "operator", "dtype", "error", "attention"]
    nodes, kernels = _tables(out)
    kinds = [r[1] for r in nodes]
    assert kinds.count("placeholder") == 5 and kinds.count("call_function") == 3
    linear = next(r for r in nodes if r[2] == "torch.nn.functional.linear")
    assert linear[3] == "float32" and float(linear[4]) < 1e-5 and "<------" not in linear
    assert kernels and all("<------" not in r for r in kernels)
    assert any("Relu" in " ".join(r) for r in kernels)


def test_correctness_report_flags_the_kernel_a_broken_rewrite_made(config, capsys, monkeypatch):
    """A pass that changes values (relu(x) becomes relu(x) * 1.5) passes the per-node check of
    the rules, but the kernel built from its rewrite is flagged."""
    import kiln.passes.pipeline as pipeline
    from kiln.passes import Sequential, graph_pass
    from kiln.passes.edit import rebuild

    @graph_pass("break_relu")
    def break_relu(graph, ctx):
        return rebuild(graph, lambda node, inputs: [kiln.ops.relu(inputs[0]) * 1.5]
                       if node.name == "Relu" else None)

    original = pipeline.default_pipeline
    monkeypatch.setattr(pipeline, "default_pipeline",
                        lambda *a, **k: Sequential([break_relu, original(*a, **k)]))
    config.correctness_report()
    model, x = _model(), torch.randn(2, 4)
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(model, backend="kiln")(x)
        assert not torch.allclose(out, model(x), atol=1e-3)
    nodes, kernels = _tables(capsys.readouterr().out)
    assert all("<------" not in r for r in nodes)
    flagged = [r for r in kernels if "<------" in r]
    assert flagged and "Relu" in " ".join(flagged[0]) and float(flagged[0][4]) > 0.1


def test_print_input_graph(config, capsys):
    config.print_input_graph()
    compile_and_compare(_model(), torch.randn(2, 4))
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].split() == ["opcode", "name", "target", "args", "kwargs"]
    assert lines[2].startswith("placeholder") and lines[-1].startswith("output")


def test_use_fp16_keeps_the_callers_dtype(config):
    config.use_fp16(True)
    _, out = compile_and_compare(_model(), torch.randn(2, 4), atol=1e-2, rtol=1e-2)
    assert out.dtype == torch.float32


def test_settings_are_validated_and_read_at_first_run(config):
    with pytest.raises(ValueError):
        config.search_space(3)
    assert config.search_space(1).use_cuda_graph(False).settings.search_space == 1
    assert config.resolve().use_cuda_graph is False


def test_search_space_is_the_tuning_level_of_the_first_run(config, monkeypatch):
    import importlib
    import os

    operator = importlib.import_module("kiln.graph.operator")
    levels, build = [], operator.build_task

    def spy(task, device, settings):
        levels.append(settings.search_space)
        return build(task, device, settings)

    monkeypatch.delenv("KILN_TUNE_LEVEL", raising=False)
    monkeypatch.setattr(operator, "build_task", spy)
    config.search_space(2)
    model, x = _model(), torch.randn(2, 4)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="kiln")
    with torch.no_grad():
        compiled(x)
        built = len(levels)
        compiled(x)  # a later run: nothing to build, no tuning
    assert built > 0 and levels == [2] * built  # the level travels as a setting, not the environment
    assert "KILN_TUNE_LEVEL" not in os.environ
