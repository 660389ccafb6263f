"""Outputs that take their argument's buffer (`Traits.in_place`, `kiln.graph.compile.in_place_input`):
a scatter into an intermediate that nothing reads afterwards updates that intermediate's
buffer, with the values of a scatter into a copy; wherever the old value is still read (by a
later node, as a graph output, through a view, through another argument of the node) or is
not the graph's own memory (an input, a constant), the result gets a buffer of its own."""
import pytest
import torch

import kiln
from kiln import ops
from kiln.graph import Traits, operator
from kiln.ir import compute
from kiln.runtime.compiled_graph import ALIGNMENT

V, D = 50, 8


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


def _symbols():
    return kiln.symbol([4, 6], "int64"), kiln.symbol([4, 6, D]), kiln.symbol([V, D])


def _values():
    ids = torch.randint(0, 10, (4, 6))     # 24 indices into 10 rows: repeated
    return ids, torch.randn(4, 6, D), torch.randn(V, D)


def _shared(compiled, step: int) -> bool:
    """Whether step `step` writes its output into the buffer of one of its inputs."""
    ins, outs = compiled.plan.steps[step]
    return outs[0] in ins


def _intermediates(compiled) -> int:
    return len({s for plan in compiled.plans.values() for s in plan.offsets})


def test_an_accumulating_index_put_updates_the_intermediate_it_starts_from():
    """The embedding backward's shape: a buffer computed in the graph (here from the input, a
    zero fill on a GPU), index_put(accumulate=True) into it, read afterwards only through the
    result. One buffer of the table's size, not two; values as torch's."""
    ids, grad, w = _symbols()
    start = ops.mul(w, 0.5)
    out = ops.mul(ops.index_put(start, [ids], grad, True), 2.0)
    compiled = kiln.trace_from(out, [ids, grad, w]).compile()
    assert _shared(compiled, 1)
    assert _intermediates(compiled) == 1
    assert compiled.workspace_bytes == _aligned(V * D * 4)
    i, g, x = _values()
    torch.testing.assert_close(compiled.run([i, g, x])[0], 2 * (0.5 * x).index_put([i], g, accumulate=True))


def test_updates_in_place_follow_each_other():
    """A second scatter into the first's result (a graph output) updates the same buffer."""
    ids, grad, w = _symbols()
    first = ops.index_put(ops.mul(w, 0.5), [ids], grad, True)
    second = ops.index_add(first, 0, ops.reshape(ids, [24]), ops.reshape(grad, [24, D]))
    compiled = kiln.trace_from(second, [ids, grad, w]).compile()
    assert _shared(compiled, 1) and _shared(compiled, 4)
    i, g, x = _values()
    want = (0.5 * x).index_put([i], g, accumulate=True).index_add(0, i.reshape(24), g.reshape(24, D))
    torch.testing.assert_close(compiled.run([i, g, x])[0], want)


def _still_read_later(ids, grad, start):
    return [ops.index_put(start, [ids], grad, True), ops.sum(start)]


def _an_output(ids, grad, start):
    return [ops.index_put(start, [ids], grad, True), start]


def _viewed(ids, grad, start):
    return [ops.mul(ops.index_put(start, [ids], grad, True), ops.reshape(ops.reshape(start, [V * D]), [V, D]))]


def _the_input(ids, grad, start):
    return [ops.index_put(start.trace[0].inputs[0], [ids], grad, True), start]


@pytest.mark.parametrize("build", [_still_read_later, _an_output, _viewed, _the_input])
def test_the_old_value_still_needed_keeps_its_buffer(build):
    """A later node reads the intermediate, the graph returns it, a view shares its memory,
    or the scatter's argument is the graph's input: the result gets a buffer of its own, and
    the old value stays what it was."""
    ids, grad, w = _symbols()
    start = ops.mul(w, 0.5)
    outs = build(ids, grad, start)
    graph = kiln.trace_from(outs, [ids, grad, w])
    compiled = graph.compile()
    scatter = next(k for k, n in enumerate(graph.nodes) if n.definition.name == "index_put")
    assert not _shared(compiled, scatter)
    i, g, x = _values()
    got = compiled.run([i, g, x])
    start_value = x if build is _the_input else 0.5 * x
    scattered = start_value.index_put([i], g, accumulate=True)
    want = {_still_read_later: [scattered, (0.5 * x).sum()], _an_output: [scattered, 0.5 * x],
            _viewed: [scattered * (0.5 * x)], _the_input: [scattered, 0.5 * x]}[build]
    torch.testing.assert_close(got, want)


def test_an_argument_read_twice_by_the_node_keeps_its_buffer():
    """scatter_add(x, 0, index, src=x): the sources read x too, at other elements."""
    w = kiln.symbol([V, D])
    index = kiln.symbol([V, D], "int64")
    start = ops.mul(w, 0.5)
    out = ops.scatter_add(start, 0, index, start)
    compiled = kiln.trace_from(out, [w, index]).compile()
    assert not _shared(compiled, 1)
    x, i = torch.randn(V, D), torch.randint(0, V, (V, D))
    torch.testing.assert_close(compiled.run([x, i])[0], (0.5 * x).scatter_add(0, i, 0.5 * x))


@operator("test_in_place_add_one", traits=Traits(in_place="x"))
def add_one(x):
    return compute(x.shape, lambda i, j: x[i, j] + 1.0)


@operator("test_in_place_shifted", traits=Traits(in_place="x"))
def shifted(x):
    """Declares `in_place` but reads x at the next row: the core refuses it."""
    rows = x.shape[0]
    return compute(x.shape, lambda i, j: x[(i + 1) % rows, j])


def test_any_operator_declaring_the_trait_takes_part_and_its_definition_is_checked():
    """An operator of no plugin's (as a plugin's) declaring `in_place` updates its argument's
    buffer; one whose definition reads the argument at other elements than the result's own
    gets a buffer of its own, whatever it declares."""
    w = kiln.symbol([V, D])
    compiled = kiln.trace_from(add_one(ops.mul(w, 0.5)), [w]).compile()
    assert _shared(compiled, 1)
    x = torch.randn(V, D)
    torch.testing.assert_close(compiled.run([x])[0], 0.5 * x + 1)
    compiled = kiln.trace_from(shifted(ops.mul(w, 0.5)), [w]).compile()
    assert not _shared(compiled, 1)
    torch.testing.assert_close(compiled.run([x])[0], torch.roll(0.5 * x, -1, 0))
