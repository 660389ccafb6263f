"""Generated values (computed from no data: fills, ranges, masks made of them) while a graph is
traced: small ones are computed at once and held as constants, larger ones stay nodes that the
graph computes where they are used, through constant folding and the other passes; a causal
mask generated so is still recognized by the attention pattern."""
import math

import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.graph import GENERATED_BYTES_HELD, known_value, tracing
from kiln.passes import FoldConstants, FuseOperators
from support import assert_close

ops = kiln.ops
LARGE = (64, GENERATED_BYTES_HELD // 64 // 4 + 1)     # float32: just over the bound


def test_operators_run_at_once_outside_tracing():
    big = ops.full(LARGE, 2.0)
    assert not big.is_symbolic and big.generated
    assert torch.equal(big.torch(), torch.full(LARGE, 2.0))
    assert not kiln.randn([3]).generated and not kiln.symbol([3]).generated


def test_tracing_records_large_generated_values_only():
    with tracing():
        small = ops.full((4, 4), 1.0)
        big = ops.full(LARGE, 1.0)
        # a large value computed from a small generated one is recorded too
        widened = ops.broadcast_to(ops.full((1, LARGE[1]), 3.0), LARGE)
        data = ops.add(kiln.randn(list(LARGE)), 1.0)       # computed from data: run at once
    assert not small.is_symbolic and small.generated
    assert big.is_symbolic and big.generated and big.trace[0].inputs == []
    assert widened.is_symbolic and widened.generated and not widened.trace[0].inputs[0].is_symbolic
    assert not data.is_symbolic and not data.generated
    assert torch.equal(known_value(widened), torch.full(LARGE, 3.0))
    assert known_value(kiln.symbol([2])) is None


def test_graphs_compute_large_fills_where_they_are_used():
    """The fill becomes no constant: constant folding keeps it a node, fusion puts it into its
    reader's kernel."""
    x = kiln.symbol(list(LARGE))
    with tracing():
        y = ops.add(x, ops.full(LARGE, 0.5))
    graph = kiln.trace_from(y, [x])
    assert graph.constants == []
    folded = FoldConstants()(graph)
    assert folded.constants == [] and len(folded.nodes) == 2
    fused = FuseOperators()(folded)
    assert len(fused.nodes) == 1 and fused.compile().constants == {}
    value = torch.randn(LARGE)
    assert_close(fused(value), value + 0.5)


def _nodes_within(graph):
    """The nodes of `graph` and of the groups fused in it."""
    for node in graph.nodes:
        yield node
        if hasattr(node, "fused_graph"):
            yield from node.fused_graph.nodes


@pytest.mark.usefixtures("fresh_dynamo")
def test_generated_causal_mask_over_the_bound_is_still_causal():
    """A float32 -inf mask of 160 x 160 (100 KiB, a node of the graph) is recognized as the
    causal one: the attention operator runs with is_causal and reads no mask."""
    length = 160
    assert length * length * 4 > GENERATED_BYTES_HELD

    def attention(q, k, v):
        mask = torch.full((length, length), float("-inf")).triu(1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + mask
        return F.softmax(scores, dim=-1) @ v

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, length, 8) for _ in range(3))
    before = set(kiln.torch.KilnFunction.live())
    assert_close(torch.compile(attention, backend="kiln")(q, k, v), attention(q, k, v), rtol=1e-4, atol=1e-5)
    (function,) = [f for f in kiln.torch.KilnFunction.live() if f not in before]
    (run,) = function.graphs.values()
    (found,) = [n for n in _nodes_within(run.graph) if n.definition.name == "attention"]
    assert found.attrs.get("is_causal") is True and len(found.inputs) == 3
