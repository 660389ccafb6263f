"""Shared helpers of the pass tests: run a graph before and after a pass, compare values."""
import torch

import kiln
from kiln.passes import PassContext


def names(graph) -> list[str]:
    return [n.name for n in graph.nodes]


def run_both(graph, opt, *inputs, atol=1e-5, rtol=1e-5):
    """Assert that `graph` and its optimized `opt` give the same outputs on `inputs`."""
    want = graph.run(list(inputs))
    got = opt.run(list(inputs))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        torch.testing.assert_close(g.torch(), w.torch(), atol=atol, rtol=rtol)


def apply(graph_pass, graph, **ctx):
    """`graph` after `graph_pass` (required, whatever its opt level) under a PassContext."""
    with PassContext(required_passes=[graph_pass.name], **ctx):
        return graph_pass(graph)


def const(*shape):
    return kiln.from_torch(torch.randn(*shape))
