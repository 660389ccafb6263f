"""A plugin's graph pass that raises or returns None: the error names the pass and its plugin."""
import types

import pytest
import torch

import kiln
from kiln.passes import graph_pass
from kiln.passes.pipeline import PassError
from kiln.plugins import hookimpl, registry, reload


@graph_pass("explodes", opt_level=0)
def explodes(graph, ctx):
    raise KeyError("no such node")


@graph_pass("forgets_to_return", opt_level=0)
def forgets_to_return(graph, ctx):
    graph.nodes[0]                      # inspects the graph, returns nothing


def _install(pass_):
    plugin = types.SimpleNamespace(kiln_graph_passes=hookimpl(lambda: [pass_]))
    registry().add_plugin("broken_pass_plugin", plugin, "kiln-broken-pass", "0.1")


@pytest.fixture
def restore_plugins():
    yield
    reload()


@pytest.mark.parametrize("pass_, message", [
    (explodes, r"graph pass 'explodes' of plugin kiln-broken-pass failed: KeyError: 'no such node'"),
    (forgets_to_return, r"graph pass 'forgets_to_return' of plugin kiln-broken-pass returned NoneType "
                        r"instead of a FlowGraph"),
])
def test_failing_plugin_pass_is_named_with_its_plugin(restore_plugins, pass_, message):
    _install(pass_)
    x = kiln.symbol([4])
    graph = kiln.trace_from(kiln.ops.relu(kiln.ops.neg(x)))
    with pytest.raises(PassError, match=message):
        kiln.graph.optimize(graph)


def test_failing_plugin_pass_is_named_through_torch_compile(restore_plugins):
    _install(forgets_to_return)
    torch._dynamo.reset()
    fn = torch.compile(lambda t: torch.relu(t) + 1, backend="kiln")
    with pytest.raises(Exception, match="graph pass 'forgets_to_return' of plugin kiln-broken-pass"):
        fn(torch.randn(3))
    torch._dynamo.reset()
