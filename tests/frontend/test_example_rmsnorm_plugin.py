"""The example third-party plugin (plugins/kiln_example_rmsnorm): its fused operator and its
higher-priority rules arrive by entry point, and decline what they do not cover."""
import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.frontend.torch import Interpreter, mapping_registry

from frontend_support import compile_and_compare

pytest.importorskip("kiln_example_rmsnorm", reason="pip install -e plugins/kiln_example_rmsnorm")


def _operators(fn, *inputs):
    gm = torch.fx.symbolic_trace(fn)
    symbols = [kiln.symbol(x.shape, x.dtype) for x in inputs]
    return [n.definition.name for n in kiln.trace_from(Interpreter(gm).run(symbols), symbols).nodes]


def test_plugin_contributes_an_operator_and_rules():
    assert kiln.ops.fused_rms_norm.name == "fused_rms_norm"
    best = mapping_registry().candidates("function", F.rms_norm)[0]
    assert (best.plugin, best.priority) == ("kiln-example-rmsnorm", 10)


def test_fused_rule_maps_last_dim_rms_norm_with_weight():
    weight = torch.randn(8)
    fused = lambda x: F.rms_norm(x, (8,), weight, 1e-6)  # noqa: E731
    assert _operators(fused, torch.randn(3, 8)) == ["fused_rms_norm"]
    compile_and_compare(fused, torch.randn(3, 8))


def test_fused_rule_declines_and_the_builtin_rule_takes_over():
    no_weight = lambda x: F.rms_norm(x, (2, 8))  # noqa: E731
    assert _operators(no_weight, torch.randn(3, 2, 8)) == ["rms_norm"]
    compile_and_compare(no_weight, torch.randn(3, 2, 8))


def test_module_rule():
    module = torch.nn.RMSNorm(8, eps=1e-5).eval()
    torch.nn.init.normal_(module.weight)
    gm = torch.fx.symbolic_trace(module)
    x = torch.randn(4, 8)
    with torch.no_grad():   # the torch-level path, where module rules apply
        out = kiln.torch.kiln_backend(gm, [x])(x)
    torch.testing.assert_close(out, module(x).detach(), atol=1e-5, rtol=1e-5)
