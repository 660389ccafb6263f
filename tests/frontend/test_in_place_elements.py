"""Inputs updated element-wise as a whole are written in place (issue 31,
`kiln.passes.in_place_elements`): a step counter's `add_(1)` (transformers' StaticCache, one per
layer) is computed by a kernel that writes the counter's own memory, with no copy written back;
where something reads the old value after the kernel, or the kernel reads the input elsewhere
than at the element it writes, the update keeps its copy. Every case ends with eager's outputs
and eager's input contents. The same cases run on a GPU in
tests/cuda/test_in_place_elements_cuda.py."""
from __future__ import annotations

import pytest
import torch

import kiln
from kiln.graph import FlowGraph, trace_from
from kiln.graph.in_place import stored_into
from kiln.ir.size import SymSize
from kiln.passes import PassContext, UpdateInPlace
from kiln.passes.fused import FusedOperator
from kiln.tensor import symbol
from support import rand
from tests.frontend.in_place_support import in_place_outputs, new_runs, runs

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

DEVICE = "cpu"


def counted_step(counter, x):
    y = x * 2 + counter
    counter.add_(1)
    return y


def counted_cache_step(keys, counter, new):
    """A layer of StaticCache: the position from the counter, the counter advanced, the new
    row stored at the position, the whole cache read."""
    position = torch.arange(1, device=keys.device) + counter
    counter.add_(1)
    keys.index_copy_(1, position, new)
    return keys.sum(1)


def _old_value_read_after(c, x):
    old = c.clone()
    c.add_(1)
    return x * old + c


def _old_value_returned(c, x):
    old = c.clone()
    c.mul_(x)
    return old, c * 2


def _flipped(c, x):
    c.copy_(c.flip(0) + x)
    return c.sum()


def _scaled_twice(c, x):
    c.mul_(1.5).add_(x)
    return x - 1


def _returns_the_input(c, x):
    return c.add_(x)


def _viewed_before(c, x):
    flat = c.view(-1)
    c.sub_(x)
    return flat * 2


def _two_inputs(c, x):
    c.add_(x)
    x.mul_(3)
    return c - x


def _read_by_a_max(c, x):
    c.sub_(c.amax())
    return x * 2


CASES = [_old_value_read_after, _old_value_returned, _flipped, _scaled_twice, _returns_the_input, _viewed_before,
         _two_inputs, _read_by_a_max]


def _run_case(fn, shape, dtype, device, calls=3):
    torch.manual_seed(7)
    f = torch.compile(fn, backend="kiln")
    c, x = rand(shape, dtype).to(device), rand(shape, dtype, nonzero=True).to(device)
    want_c, want_x = c.clone(), x.clone()
    for _ in range(calls):
        got, expected = f(c, x), fn(want_c, want_x)
        torch.testing.assert_close(got, expected)
        torch.testing.assert_close(c, want_c)     # a kernel may contract c * 1.5 + x into one rounding
        torch.testing.assert_close(x, want_x)


@pytest.mark.parametrize("fn", CASES)
def test_eager_values_whatever_reads_the_input(fn):
    """Old values read after the update, returned, read through a view taken before; the update
    reading the input elsewhere (a flip, a max), two updates in a row, two inputs updated, the
    updated input returned: outputs and inputs are eager's at each call."""
    _run_case(fn, (3, 5, 7), torch.float32, DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
@pytest.mark.parametrize("shape", [(), (7,), (3, 5, 7), (0, 4)])
def test_a_counter_is_advanced_in_place(shape, dtype):
    """`counter.add_(1)` of any shape (a scalar, odd sizes, no elements) and dtype: eager's
    values at each call, the counter's own memory written and nothing copied back."""
    torch.manual_seed(8)
    before = {id(r) for r in runs()}
    f = torch.compile(counted_step, backend="kiln")
    counter, x = rand(shape, dtype).to(DEVICE), rand(shape, dtype).to(DEVICE)
    want = counter.clone()
    address = counter.data_ptr()
    for _ in range(3):
        torch.testing.assert_close(f(counter, x), counted_step(want, x))
        torch.testing.assert_close(counter, want, rtol=0, atol=0)
    assert counter.data_ptr() == address
    (run,) = new_runs(before)
    assert in_place_outputs(run) == [len(run.compiled.outputs) - 1]


def test_nothing_is_copied_into_the_counter(monkeypatch):
    counter, x = torch.tensor(5, device=DEVICE), torch.randn(4, device=DEVICE)
    want = counter.clone()
    copied = []
    original = torch.Tensor.copy_

    def copy_(self, src, *args, **kwargs):
        if self.data_ptr() == counter.data_ptr():
            copied.append(tuple(self.shape))
        return original(self, src, *args, **kwargs)

    f = torch.compile(counted_step, backend="kiln")
    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    for _ in range(3):
        torch.testing.assert_close(f(counter, x), counted_step(want, x))
    monkeypatch.undo()
    assert counter.item() == want.item() == 8
    assert copied == []


def test_a_non_contiguous_input_gets_eager_values():
    """An input passed transposed is made contiguous for the run: the kernel writes that copy,
    which is written back."""
    torch.manual_seed(9)
    f = torch.compile(_scaled_twice, backend="kiln", dynamic=False)
    c, x = torch.randn(6, 5, device=DEVICE).t(), torch.randn(5, 6, device=DEVICE)
    assert not c.is_contiguous()
    want = c.clone()
    for _ in range(3):
        torch.testing.assert_close(f(c, x), _scaled_twice(want, x))
        torch.testing.assert_close(c, want)


def check_a_cache_layer_writes_nothing_back(device):
    """A StaticCache layer's step: the counter advanced and the keys stored, both in place (every
    written-back output is its input's own buffer), with eager's values."""
    torch.manual_seed(10)
    before = {id(r) for r in runs()}
    f = torch.compile(counted_cache_step, backend="kiln")
    keys, counter = torch.randn(2, 16, 8, device=device), torch.tensor(3, device=device)
    want_keys, want_counter = keys.clone(), counter.clone()
    for _ in range(4):
        new = torch.randn(2, 1, 8, device=device)
        torch.testing.assert_close(f(keys, counter, new), counted_cache_step(want_keys, want_counter, new))
        torch.testing.assert_close(keys, want_keys, rtol=0, atol=0)
        assert counter.item() == want_counter.item()
    (run,) = new_runs(before)
    first = len(run.compiled.outputs) - len(run.writeback)
    assert in_place_outputs(run) == list(range(first, len(run.compiled.outputs))) and len(run.writeback) == 2


def test_a_cache_layer_writes_nothing_back():
    check_a_cache_layer_writes_nothing_back(DEVICE)


def test_the_pass_disabled_copies_the_counter_back():
    before = {id(r) for r in runs()}
    with PassContext(disabled_passes={"update_in_place"}):
        counter, x = torch.tensor(2, device=DEVICE), torch.randn(3, device=DEVICE)
        f = torch.compile(counted_step, backend="kiln")
        f(counter, x)
    assert counter.item() == 3
    (run,) = new_runs(before)
    assert not in_place_outputs(run)


def _written(nodes: list, outputs: list, inputs: list) -> tuple[list[int], FlowGraph]:
    """The outputs UpdateInPlace computes in place in the graph of `nodes` (in this order),
    whose last output is written back into the first input, and the graph it makes."""
    graph = FlowGraph(outputs, inputs, [t.trace[0] for t in nodes])
    update = UpdateInPlace({len(outputs) - 1: 0})
    out = update(graph)
    return update.in_place, out


def test_a_reader_of_the_old_value_before_the_new_values_readers_lets_the_kernel_move_down():
    x, y = symbol((3, 5)), symbol((3, 5))
    new = kiln.ops.add(x, 1.0)
    old_read = kiln.ops.mul(x, y)                # after the update in the given order
    new_read = kiln.ops.mul(new, 3.0)
    placed, graph = _written([new, old_read, new_read], [old_read, new_read, new], [x, y])
    assert placed == [2]
    (marked,) = [n for n in graph.nodes if stored_into(n)]
    assert graph.nodes.index(marked) == 1, "moved down past the old value's reader"
    a, b = torch.randn(3, 5), torch.randn(3, 5)
    old, want = a.clone(), a + 1
    outs = graph.compile().run([a, b])
    torch.testing.assert_close(outs[0], old * b)
    torch.testing.assert_close(outs[1], want * 3)
    assert outs[2] is a
    torch.testing.assert_close(a, want)


@pytest.mark.parametrize("through_view", [False, True])
def test_a_reader_of_the_old_value_after_the_new_values_keeps_the_copy(through_view):
    x = symbol((3, 5))
    view = kiln.ops.reshape(x, [15])
    new = kiln.ops.add(x, 1.0)
    new_read = kiln.ops.mul(new, 3.0)
    old_read = kiln.ops.mul(view, 2.0) if through_view else kiln.ops.mul(x, 2.0)
    nodes = [view, new, new_read, old_read] if through_view else [new, new_read, old_read]
    placed, _ = _written(nodes, [new_read, old_read, new], [x])
    assert placed == []


def test_a_kernel_reading_the_input_elsewhere_keeps_the_copy():
    x = symbol((4, 3))
    new = kiln.ops.add(kiln.ops.flip(x, [0]), 1.0)
    graph = kiln.graph.optimize(trace_from([new], [x]))
    update = UpdateInPlace({0: 0})
    update(graph)
    assert update.in_place == []


def test_another_output_of_the_kernel_reading_the_input_keeps_the_copy():
    """The new value and a value computed from it in one kernel: that output would read
    elements the kernel already wrote."""
    x = symbol((4, 3))
    new = kiln.ops.add(x, 1.0)
    doubled = kiln.ops.mul(new, 2.0)
    node = FusedOperator([new.trace[0], doubled.trace[0]], [x], [doubled, new], 0)
    update = UpdateInPlace({1: 0})
    update(FlowGraph(node.outputs, [x], [node]))
    assert update.in_place == []


def test_a_chain_through_16_bit_values_of_the_same_shape_is_written_in_place():
    """A bfloat16 chain reads the input through the computes it inlines, each at its own
    element: written in place, values as the out-of-place kernel's."""
    x = symbol((3, 5, 7), torch.bfloat16)
    new = kiln.ops.add(kiln.ops.mul(kiln.ops.exp(x), 0.5), 1.0)
    graph = kiln.graph.optimize(trace_from([new], [x]))
    update = UpdateInPlace({0: 0})
    placed = update(graph)
    assert update.in_place == [0]
    a = rand((3, 5, 7), torch.bfloat16)
    want = graph.run([a.clone()])[0].torch()
    got = placed.compile().run([a])[0]
    assert got is a
    torch.testing.assert_close(a, want, rtol=0, atol=0)


def test_symbolic_sizes_keep_the_copy():
    x = symbol((SymSize.named("s0", 6), 4))
    graph = kiln.graph.optimize(trace_from([kiln.ops.add(x, 1.0)], [x]))
    update = UpdateInPlace({0: 0})
    update(graph)
    assert update.in_place == []
