"""FlowGraph: tracing from symbolic tensors, printing in the quick-start format, running."""
from __future__ import annotations

import pytest
import torch

import kiln
from kiln.graph import OperatorError, operator
from kiln.ir import compute
from support import assert_close, rand


@operator("scale_shift")
def scale_shift(x, scale=2.0, shift=0.0):
    """A test-local operator with attributes: x * scale + shift."""
    return compute(x.shape, lambda *i: x[i] * scale + shift)


@operator("split_signs")
def split_signs(x):
    """A test-local operator with two outputs: (x * 2, -x)."""
    return compute(x.shape, lambda *i: x[i] * 2), compute(x.shape, lambda *i: -x[i])


def test_quick_start_graph_prints_in_its_format():
    a, b, c = kiln.randn([2, 3]), kiln.randn([3, 2]), kiln.randn([2])
    x = kiln.symbol_like(a)
    y = kiln.ops.matmul(x, b) + c
    assert str(kiln.trace_from(y)) == (
        "Graph(x: float32[2, 3][cpu]){\n"
        "  c = Constant(float32[3, 2][cpu])\n"
        "  c_1 = Constant(float32[2][cpu])\n"
        "  x_1: float32[2, 2][cpu] = Matmul(x, c)\n"
        "  x_2: float32[2, 2][cpu] = Add(x_1, c_1)\n"
        "  return x_2\n"
        "}")
    assert_close(kiln.trace_from(y)(a), a.torch() @ b.torch() + c.torch())


def test_attributes_multiple_outputs_and_inputs_print():
    x = kiln.symbol([4], "float64")
    w = kiln.symbol([4], "float64")
    p, n = split_signs(scale_shift(x, 3.0, shift=1.0))
    graph = kiln.trace_from([n, p * w], inputs=[x, w])
    assert str(graph) == (
        "Graph(x: float64[4][cpu], x_1: float64[4][cpu]){\n"
        "  x_2: float64[4][cpu] = ScaleShift(x, scale=3.0, shift=1.0)\n"
        "  x_3: float64[4][cpu], x_4: float64[4][cpu] = SplitSigns(x_2)\n"
        "  x_5: float64[4][cpu] = Mul(x_3, x_1)\n"
        "  return x_4, x_5\n"
        "}")


def test_attributes_left_at_their_default_are_not_printed():
    x = kiln.symbol([2])
    graph = kiln.trace_from(scale_shift(scale_shift(x), 2, shift=0.0))
    assert str(graph).splitlines()[1:3] == ["  x_1: float32[2][cpu] = ScaleShift(x)",
                                            "  x_2: float32[2][cpu] = ScaleShift(x_1, scale=2)"]


def test_trace_from_follows_explicit_input_order():
    a, b = kiln.symbol([3]), kiln.symbol([3])
    y = a - b
    assert kiln.trace_from(y).inputs == [a, b]
    swapped = kiln.trace_from(y, inputs=[b, a])
    assert [t is u for t, u in zip(swapped.inputs, [b, a])] == [True, True]
    va, vb = rand((3,)), rand((3,))
    assert_close(swapped(vb, va), va - vb)
    assert str(swapped).startswith("Graph(x: float32[3][cpu], x_1: float32[3][cpu]){\n"
                                   "  x_2: float32[3][cpu] = Sub(x_1, x)\n")


def test_trace_from_rejects_missing_inputs_and_accepts_unused_ones():
    a, b, unused = kiln.symbol([3]), kiln.symbol([3]), kiln.symbol([5])
    y = a * b
    with pytest.raises(ValueError, match=r"depend on 1 symbolic tensor\(s\) not given as inputs: float32\[3\]\[cpu\]"):
        kiln.trace_from(y, inputs=[a])
    graph = kiln.trace_from(y, inputs=[a, b, unused])
    va, vb = rand((3,)), rand((3,))
    assert_close(graph(va, vb, rand((5,))), va * vb)


def test_trace_from_a_chain_deeper_than_pythons_recursion_limit():
    """Before: XLNet's training graph under bfloat16 autocast crashed tracing with a
    RecursionError (the walk from the outputs recursed once per operator in a chain)."""
    import sys
    x, other = kiln.symbol([3]), kiln.symbol([3])
    y = x
    for k in range(sys.getrecursionlimit() + 500):
        y = y * 1.5 if k % 2 else y - other
    graph = kiln.trace_from(y)
    assert graph.inputs == [x, other] and len(graph.nodes) == sys.getrecursionlimit() + 500
    assert [n.name for n in graph.nodes[:3]] == ["Sub", "Mul", "Sub"]


def test_shared_subexpression_is_one_node_and_graph_runs():
    x = kiln.symbol([2, 5], "float32")
    h = kiln.ops.relu(x)
    y = h * h + h
    graph = kiln.trace_from(y)
    assert [n.name for n in graph.nodes] == ["Relu", "Mul", "Add"]
    value = rand((2, 5))
    r = torch.relu(value)
    assert_close(graph(kiln.from_torch(value)), r * r + r)
    assert_close(graph(value), r * r + r)


def test_graph_with_several_outputs_returns_a_tuple():
    x = kiln.symbol([6])
    p, n = split_signs(x)
    value = rand((6,))
    out = kiln.trace_from([p, n])(value)
    assert isinstance(out, tuple) and len(out) == 2
    assert_close(out, (value * 2, -value))
    assert_close(kiln.trace_from([p, n]).run([value]), [value * 2, -value])


def test_graph_checks_its_inputs():
    graph = kiln.trace_from(kiln.ops.relu(kiln.symbol([2, 3])))
    with pytest.raises(OperatorError, match="graph takes 1 inputs, got 2"):
        graph(rand((2, 3)), rand((2, 3)))
    with pytest.raises(OperatorError, match=r"graph input expects float32\[2, 3\]\[cpu\], got float32\[3, 2\]"):
        graph(rand((3, 2)))
    with pytest.raises(OperatorError, match=r"expects float32\[2, 3\]\[cpu\], got int32\[2, 3\]"):
        graph(rand((2, 3), torch.int32))


def test_graph_runs_non_contiguous_inputs_and_constants():
    c = kiln.from_torch(rand((4, 3)).t())
    x = kiln.symbol([3, 4])
    graph = kiln.trace_from(scale_shift(x, 0.5) + c)
    value = rand((4, 3)).t()
    assert_close(graph(value), value * 0.5 + c.torch())


def test_imperative_and_traced_results_agree():
    a, b = kiln.randn([3, 4]), kiln.randn([4])
    eager = scale_shift(a, 2.0, 1.0) * b
    x = kiln.symbol_like(a)
    traced = kiln.trace_from(scale_shift(x, 2.0, 1.0) * b)(a)
    assert_close(traced, eager.torch())
    assert_close(eager, (a.torch() * 2.0 + 1.0) * b.torch())


def test_a_fill_runs_just_before_its_reader_and_is_not_held_meanwhile():
    """An operator reading no tensor (a fill recorded while tracing, as AOTAutograd's backward
    makes an embedding gradient's zeros first) comes right before its first reader in the
    traced order, not ahead of the reader's other inputs: its buffer is not live while they are
    computed, and the plan's workspace is smaller than with the fill first."""
    from kiln.graph import FlowGraph, tracing
    x = kiln.symbol([64, 4096])
    with tracing():
        fill = kiln.ops.full([64, 4096], 0.5)           # 1 MiB: recorded, not computed now
        chain = x
        for _ in range(4):                               # intermediates live one after another
            chain = kiln.ops.exp(kiln.ops.neg(chain))
        y = kiln.ops.add(fill, chain)
    graph = kiln.trace_from(y, [x])
    names = [n.definition.name for n in graph.nodes]
    assert names[-2:] == ["full", "add"], names
    fill_first = FlowGraph(graph.outputs, graph.inputs, [graph.nodes[-2], *graph.nodes[:-2], graph.nodes[-1]])
    assert graph.compile().workspace_bytes < fill_first.compile().workspace_bytes
    a = torch.randn(64, 4096)
    want = 0.5 + torch.exp(-torch.exp(-torch.exp(-torch.exp(-a))))
    assert_close(graph(a), want)
    assert_close(fill_first(a), want)


def test_in_memory_order_reads_each_value_last_as_soon_as_it_can():
    """Issue 32: a backward returns each layer's weight gradient, made from the gradient flowing
    through that layer; in `trace_from`'s order (the outputs' order) the walk computed the
    whole chain first and the weight gradients after it, holding every layer's gradient to the
    end. `in_memory_order` runs a sum as soon as the value it reads is ready, and takes an
    operator's deepest input first: each value is freed once the chain moves on, and the
    workspace is smaller, with the same results."""
    x = kiln.symbol([64, 4096])
    chain, grads = x, []
    for _ in range(4):
        chain = kiln.ops.exp(kiln.ops.neg(chain))
        grads.append(kiln.ops.sum(chain, [1]))
    graph = kiln.trace_from([kiln.ops.sum(chain), *grads], [x])
    ordered = kiln.graph.in_memory_order(graph)
    assert sorted(map(id, ordered.nodes)) == sorted(map(id, graph.nodes))
    assert ordered.compile().workspace_bytes < graph.compile().workspace_bytes
    a = torch.randn(64, 4096)
    for got, want in zip(ordered.run([a]), graph.run([a])):
        torch.testing.assert_close(got.torch(), want.torch())
