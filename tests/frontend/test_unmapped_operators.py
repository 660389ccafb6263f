"""Unmapped operators: one error listing all of them, the listing API and CLI, and
fallback_to_eager running them in PyTorch."""
import io
import warnings
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch

import kiln
from kiln.cli import main
from kiln.frontend.torch import dynamo_config, unmapped_operators

from frontend_support import Capture, compile_and_compare
from unmapped_model import example

EXPECTED = [("torch.Tensor.i0", "method", 1), ("torch.special.bessel_j0", "function", 2),
            ("torch.special.i0", "function", 1)]


def test_one_error_lists_every_unmapped_target_sorted_with_kind_and_count():
    model, inputs = example()
    torch._dynamo.reset()
    with torch.no_grad(), pytest.raises(Exception) as info:  # torch-level names (not ATen's)
        torch.compile(model, backend="kiln")(*inputs)
    error = getattr(info.value, "inner_exception", info.value)  # dynamo wraps backend errors
    assert isinstance(error, kiln.UnmappedOperatorError), repr(info.value)
    assert isinstance(error, NotImplementedError)
    assert [(o.name, o.kind, o.count) for o in error.operators] == EXPECTED
    lines = str(error).splitlines()
    assert "torch.special.bessel_j0  function  2 nodes" in [line.strip() for line in lines]
    assert "CONTRIBUTING.md" in str(error)


def test_unmapped_operators_lists_without_compiling():
    model, inputs = example()
    found = unmapped_operators(model, *inputs)
    assert [(o.name, o.kind, o.count) for o in found] == EXPECTED
    assert "bessel_j0" in found[1].example


def test_cli_prints_the_table():
    out = io.StringIO()
    with redirect_stdout(out):
        status = main(["unmapped", f"{Path(__file__).parent / 'unmapped_model.py'}:example"])
    lines = out.getvalue().splitlines()
    assert status == 1
    assert lines[0].split() == ["operator", "kind", "count", "example", "node"]
    assert lines[2].split()[:3] == ["torch.Tensor.i0", "method", "1"]


def test_fallback_to_eager_runs_unmapped_nodes_in_torch():
    model, inputs = example()
    dynamo_config.fallback_to_eager(True)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            capture, _ = compile_and_compare(model, *inputs)
    finally:
        dynamo_config.fallback_to_eager(False)
    assert any("torch.special.i0" in str(w.message) for w in caught)
    split = capture.compiled[0]
    compiled = [m for m in vars(split).values() if isinstance(m, kiln.torch.KilnFunction)]
    assert compiled, "the mapped parts should run in Kiln"
    assert all(f.graphs for f in compiled)


def test_unmapped_targets_are_named_by_their_qualified_names():
    """An overload packet (`torch.ops.aten._weight_int4pack_mm`) and a private builtin of torch
    (`torch._weight_int4pack_mm`) are named as written, not by pybind11's mangled class
    ('torch._ops.aten.pybind11_detail_function_record_...') or 'torch._VariableFunctionsClass'
    (issue 30)."""
    from kiln.frontend.torch import Interpreter, kiln_backend
    from kiln.frontend.torch.errors import target_name

    graph = torch.fx.Graph()
    a, b, size, scales = (graph.placeholder(n) for n in ("a", "b", "size", "scales"))
    args = (a, b, size, scales)
    packet = graph.call_function(torch.ops.aten._weight_int4pack_mm, args)
    builtin = graph.call_function(torch._weight_int4pack_mm, args)
    overload = graph.call_function(torch.ops.aten._weight_int4pack_mm.default, args)
    graph.output((packet, builtin, overload))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    names = [o.name for o in Interpreter(gm).unmapped()]
    assert names == ["aten._weight_int4pack_mm", "aten._weight_int4pack_mm.default", "torch._weight_int4pack_mm"]
    inputs = [torch.randn(4, 8), torch.randn(2, 8), torch.tensor(32), torch.randn(2, 2, 2)]
    with pytest.raises(kiln.UnmappedOperatorError) as info:
        kiln_backend(gm, inputs)(*inputs)
    assert "pybind11" not in str(info.value) and "_VariableFunctionsClass" not in str(info.value)
    assert "aten._weight_int4pack_mm  " in str(info.value) and "torch._weight_int4pack_mm  " in str(info.value)
    assert target_name("function", torch.ops.higher_order.cond) == "torch.ops.higher_order.cond"
    assert target_name("function", torch._C._nn.gelu) == "torch.nn.functional.gelu"


def test_method_rules_registered_by_the_method_itself_are_named_by_its_name():
    """A rule for `torch.Tensor.addcdiv` (the method object, as `kiln plugins` lists the rules)
    is named 'torch.Tensor.addcdiv', not "torch.Tensor.<method 'addcdiv' of ...>" (issue 34)."""
    from kiln.frontend.torch.errors import target_name

    assert target_name("method", torch.Tensor.addcdiv) == "torch.Tensor.addcdiv"
    assert target_name("method", torch.Tensor.__rsub__) == "torch.Tensor.__rsub__"
    assert target_name("method", "view") == "torch.Tensor.view"
