"""Horizontal fusion (`kiln.passes.horizontal`, issue 31): independent tiny element-wise kernels
of one step become one launch with several outputs, values as before; kernels that depend on
each other, whose results a kernel between them reads, that are large, or that would read an
input another writes in place stay apart."""
from __future__ import annotations

import pytest
import torch

import kiln
from kiln import ops
from kiln.graph import FlowGraph, trace_from
from kiln.graph.in_place import stored_into
from kiln.passes import MergeIndependentKernels, PassContext, UpdateInPlace
from kiln.passes.horizontal import SMALL_ELEMENTS
from kiln.runtime import cuda as rt
from kiln.schedule.choose import choose
from support import rand
from tests.passes.passes_support import apply, run_both


def _in_order(outputs: list, inputs: list) -> FlowGraph:
    """The graph computing `outputs` (each from a node of its own) in the given order."""
    return FlowGraph(outputs, inputs, [t.trace[0] for t in outputs])


def test_independent_tiny_kernels_become_one_launch():
    """A scalar counter, a rotary-sized table, a row of odd length, of three dtypes: one node,
    one CUDA launch, the values of the kernels apart."""
    c, t, r = kiln.symbol([], "int64"), kiln.symbol([1, 64]), kiln.symbol([3, 7], "bfloat16")
    graph = _in_order([ops.add(c, 1), ops.cos(t), ops.exp(r)], [c, t, r])
    merged = apply(MergeIndependentKernels(), graph)
    (node,) = merged.nodes
    assert len(node.outputs) == 3
    assert len(choose(node.task, "cuda", 90).launches) == 1
    run_both(graph, merged, rand((), torch.int64), rand((1, 64)), rand((3, 7), torch.bfloat16))


def test_tensors_of_no_elements_merge():
    a, b = kiln.symbol([0, 3]), kiln.symbol([5])
    graph = _in_order([ops.neg(a), ops.mul(b, 2.0)], [a, b])
    merged = apply(MergeIndependentKernels(), graph)
    assert len(merged.nodes) == 1
    run_both(graph, merged, torch.randn(0, 3), rand((5,)))


def test_a_kernel_reading_the_other_stays_apart():
    x = kiln.symbol([4, 5])
    first = ops.add(x, 1.0)
    graph = _in_order([first, ops.mul(first, 3.0)], [x])
    assert len(apply(MergeIndependentKernels(), graph).nodes) == 2


def test_a_reader_between_keeps_the_earlier_kernel_in_place():
    """The earlier kernel's value is read by a node between the two: moving it down past that
    reader would break the order, so they stay apart."""
    x, w = kiln.symbol([4, 8]), kiln.symbol([8, 8])
    first = ops.add(x, 1.0)
    between = ops.matmul(first, w)
    last = ops.mul(x, 2.0)
    graph = _in_order([first, between, last], [x, w])
    opt = apply(MergeIndependentKernels(), graph)
    assert len(opt.nodes) == 3
    run_both(graph, opt, rand((4, 8)), rand((8, 8)))


def test_the_earlier_kernel_moves_down_past_nodes_that_do_not_read_it():
    x, w = kiln.symbol([4, 8]), kiln.symbol([8, 8])
    first = ops.add(x, 1.0)
    between = ops.matmul(x, w)
    last = ops.mul(between, 2.0)
    graph = _in_order([first, between, last], [x, w])
    opt = apply(MergeIndependentKernels(), graph)
    assert [len(n.outputs) for n in opt.nodes] == [1, 2]
    run_both(graph, opt, rand((4, 8)), rand((8, 8)))


def test_large_kernels_stay_apart():
    a, b = kiln.symbol([SMALL_ELEMENTS + 1]), kiln.symbol([3])
    graph = _in_order([ops.neg(a), ops.mul(b, 2.0)], [a, b])
    assert len(apply(MergeIndependentKernels(), graph).nodes) == 2


def test_the_pass_disabled_keeps_the_kernels():
    a, b = kiln.symbol([3]), kiln.symbol([3])
    graph = _in_order([ops.neg(a), ops.mul(b, 2.0)], [a, b])
    with PassContext(disabled_passes={"merge_independent_kernels"}):
        assert len(MergeIndependentKernels()(graph).nodes) == 2


def _counters(count: int):
    """`count` scalar counters, each advanced by one and written back into itself."""
    inputs = [kiln.symbol([], "int64") for _ in range(count)]
    return inputs, [ops.add(c, 1) for c in inputs]


def test_counters_written_in_place_merge_and_stay_in_place():
    """Three counters advanced in place (`kiln.passes.in_place_elements`): one kernel writes all
    three into their own memory."""
    inputs, news = _counters(3)
    graph = UpdateInPlace({k: k for k in range(3)})(_in_order(news, inputs))
    merged = apply(MergeIndependentKernels(), graph)
    (node,) = merged.nodes
    assert stored_into(node) == {0: 0, 1: 1, 2: 2}
    values = [torch.tensor(k * 10) for k in range(3)]
    outs = merged.compile().run(values)
    assert all(o is v for o, v in zip(outs, values))
    assert [v.item() for v in values] == [1, 11, 21]


def test_a_reader_of_a_counters_old_value_stays_apart_from_its_update():
    """A kernel reading the counter's old value, merged with the kernel writing the counter,
    could read it after the write: they stay apart, and the old value is read."""
    c, x = kiln.symbol([5], "int64"), kiln.symbol([5], "int64")
    reader = ops.mul(c, x)
    new = ops.add(c, 1)
    graph = UpdateInPlace({1: 0})(_in_order([reader, new], [c, x]))
    assert any(stored_into(n) for n in graph.nodes)
    opt = apply(MergeIndependentKernels(), graph)
    assert len(opt.nodes) == 2
    counter, factor = torch.arange(5), torch.arange(5) + 3
    outs = opt.compile().run([counter, factor])
    assert outs[0].tolist() == (torch.arange(5) * factor).tolist()
    assert counter.tolist() == (torch.arange(5) + 1).tolist()


def test_a_kernel_reading_an_input_stays_before_the_kernel_that_writes_it():
    """A small kernel reading the old value of a large input, then a large kernel writing that
    input in place, then a small independent kernel: the first must not move past the write."""
    x, y = kiln.symbol([5000]), kiln.symbol([3])
    head = ops.slice(x, 0, 0, 5)
    graph = UpdateInPlace({2: 0})(_in_order([head, ops.neg(y), ops.mul(x, 3.0)], [x, y]))
    assert [bool(stored_into(n)) for n in graph.nodes] == [False, False, True]
    graph = FlowGraph(graph.outputs, graph.inputs, [graph.nodes[k] for k in (0, 2, 1)])
    opt = apply(MergeIndependentKernels(), graph)
    assert len(opt.nodes) == 3
    values, other = torch.randn(5000), torch.randn(3)
    old = values.clone()
    outs = opt.compile().run([values, other])
    torch.testing.assert_close(outs[0], old[:5])
    torch.testing.assert_close(values, old * 3)


@pytest.mark.skipif(not rt.nvrtc_available(), reason="cuda-bindings / nvidia-cuda-nvrtc not installed")
def test_the_merged_kernels_compile_for_cuda():
    """A merged group of CUDA nodes, one of them stored into its input: one launch, built by
    NVRTC for sm_80 and sm_90."""
    sym = lambda shape, dt="float32": kiln.symbol(list(shape), dt, "cuda")
    c, t, m = sym((), "int64"), sym((1, 1, 64), "bfloat16"), sym((1, 161), "int64")
    outs = [ops.cos(t), ops.le(m, 3), ops.add(c, 1)]
    graph = UpdateInPlace({2: 0})(_in_order(outs, [c, t, m]))
    (node,) = apply(MergeIndependentKernels(), graph).nodes
    assert stored_into(node)
    program = choose(node.task, "cuda", 90)
    assert len(program.launches) == 1
    rt.compile_many([(rt.launch_source(program, arch), "merged", arch) for arch in ("sm_80", "sm_90")], workers=2)
