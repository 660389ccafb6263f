"""CompiledGraph: same values as node-by-node interpretation, a sound and compact memory plan,
no workspace allocation after the first run, and CUDA graph replay over the fixed workspace."""
import random

import pytest
import torch

import kiln
from kiln.graph import optimize, run_task
from kiln.graph.compile import copies_input
from kiln.runtime.compiled_graph import ALIGNMENT, lent_layout, plan_memory, plan_with_regions
from tests.support import assert_close


def interpret(graph, inputs):
    """The graph's outputs computed node by node, every intermediate allocated by torch."""
    values = {id(s): t for s, t in zip(graph.inputs, inputs)}
    for node in graph.nodes:
        args = [values[id(t)] if id(t) in values else t.torch() for t in node.inputs]
        for sym, out in zip(node.outputs, run_task(node.task, node.device, args)):
            values[id(sym)] = out
    return [values[id(t)] if id(t) in values else t.torch() for t in graph.outputs]


def chain(n=8, shape=(64, 64), device="cpu"):
    x = kiln.symbol(shape, "float32", device)
    y = x
    for k in range(n):
        y = kiln.ops.add(kiln.ops.mul(y, 0.5), float(k)) if k % 2 else kiln.ops.tanh(y)
    return kiln.trace_from(y, [x])


def multi_output():
    """Multi-output operators (split, max_dim), an unused output, a constant, an output that is
    also an input, and the same output twice."""
    x = kiln.symbol((6, 12), "float32", "cpu")
    c = kiln.from_torch(torch.randn(6, 4))
    a, b, _ = kiln.ops.split(x, 4, 1)
    values, indices = kiln.ops.max_dim(kiln.ops.mul(a, b), 1)
    y = kiln.ops.add(kiln.ops.relu(a), c)
    return kiln.trace_from([y, values, indices, x, y], [x])


def fused():
    """A graph that the default pipeline fuses (elementwise chains into reductions)."""
    x = kiln.symbol((16, 32), "float32", "cpu")
    w = kiln.from_torch(torch.randn(32, 32) * 0.1)
    h = kiln.ops.relu(kiln.ops.add(kiln.ops.matmul(x, w), 1.0))
    s = kiln.ops.sum(kiln.ops.exp(kiln.ops.mul(h, 0.1)), 1)
    return optimize(kiln.trace_from([s, kiln.ops.softmax(h, -1)], [x]))


def views():
    """Reshapes run as views: of an intermediate whose memory later buffers could take if the
    view did not keep it live, of an input, of a view; and one the graph returns, which gets
    memory of its own."""
    x = kiln.symbol((8, 16), "float32", "cpu")
    v = kiln.ops.reshape(kiln.ops.tanh(x), (16, 8))
    c = kiln.ops.expand(kiln.ops.mul(kiln.ops.exp(x), 2.0), (8, 16))      # an expand to the same shape
    w = kiln.ops.flatten(kiln.ops.unsqueeze(kiln.ops.reshape(x, (4, 32)), 0), 0, 1)
    out = kiln.ops.add(kiln.ops.reshape(kiln.ops.sigmoid(c), (16, 8)), v)
    return kiln.trace_from([out, kiln.ops.reshape(out, (128,)), kiln.ops.relu(w)], [x])


GRAPHS = {"chain": chain, "multi_output": multi_output, "fused": fused, "views": views}


def inputs_for(graph):
    return [torch.randn(t.shape, device=t.device.torch()) for t in graph.inputs]


def assert_plan_sound(compiled):
    """No two intermediates whose lifetimes intersect share a byte; offsets are aligned."""
    for plan in compiled.plans.values():
        spans = [(s, plan.offsets[s], plan.offsets[s] + compiled.buffers[s].nbytes) for s in plan.offsets]
        for s, start, end in spans:
            assert start % ALIGNMENT == 0 and end <= plan.size
            for t, other_start, other_end in spans:
                if s < t and start < end and other_start < other_end:
                    (a0, a1), (b0, b1) = compiled.lifetimes[s], compiled.lifetimes[t]
                    if a0 <= b1 and b0 <= a1:
                        assert end <= other_start or other_end <= start, (s, t)


@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_values_match_node_by_node_interpretation(name):
    graph = GRAPHS[name]()
    for _ in range(2):                          # the second run reuses the workspace
        inputs = inputs_for(graph)
        got = graph.run(inputs)
        want = interpret(graph, inputs)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert g.torch().dtype == w.dtype and tuple(g.shape) == tuple(w.shape)
            assert_close(g.torch(), w)


def test_fused_graph_has_fused_nodes():
    assert any(type(n).__name__ == "FusedOperator" for n in fused().nodes)


@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_plan_never_overlaps_live_buffers(name):
    assert_plan_sound(GRAPHS[name]().compile())


def test_outputs_inputs_and_constants_are_not_in_the_workspace():
    graph = multi_output()
    compiled = graph.compile()
    placed = {s for plan in compiled.plans.values() for s in plan.offsets}
    assert not placed & (set(compiled.inputs) | set(compiled.outputs))
    x = torch.randn(6, 12)
    outs = graph.run([x])
    assert outs[3].torch() is x and outs[0].torch() is outs[4].torch()


def test_reshapes_run_as_views_of_their_inputs_memory():
    graph = views()
    compiled = graph.compile()
    viewed = [s for s, step in zip(compiled.steps, graph.nodes) if step.definition.name in ("reshape", "flatten",
                                                                                          "unsqueeze", "expand")]
    assert len(compiled.views) == len(viewed) - 1, "every reshape but the returned one is a view"
    placed = {s for plan in compiled.plans.values() for s in plan.offsets}
    assert not placed & set(compiled.views)
    x = torch.randn(8, 16)
    out, flat, _ = graph.run([x])
    assert flat.torch().untyped_storage().data_ptr() != out.torch().untyped_storage().data_ptr()


def test_only_element_for_element_copies_are_views():
    x = kiln.symbol((8, 1, 16), "float32", "cpu")
    same, wider = kiln.ops.expand(x, (8, 1, 16)), kiln.ops.expand(x, (8, 3, 16))
    graph = kiln.trace_from([kiln.ops.relu(same), kiln.ops.relu(wider)], [x])
    assert [copies_input(n.task) for n in graph.nodes if n.definition.name == "expand"] == [True, False]


def test_workspace_is_smaller_than_the_intermediates_on_a_chain():
    graph = chain(n=10)
    compiled, one = graph.compile(), 64 * 64 * 4
    assert compiled.intermediate_bytes == (len(graph.nodes) - 1) * one
    assert compiled.workspace_bytes == 2 * one       # a chain needs two live buffers at a time


def test_the_largest_buffers_first_where_that_needs_less():
    """A plan taking buffers in order of first use put the early ones at the low offsets and left
    a hole too small for a large later one (2,048 bytes here, and ResNet-50's backward workspace
    376 MB for 310 MB live at once); largest first, it needs what is live at once at most."""
    sizes = {0: 256, 1: 768, 2: 512, 3: 512}
    live = {0: (2, 5), 1: (4, 4), 2: (0, 5), 3: (1, 3)}
    plan = plan_memory(sizes, live)
    assert plan.size == max(sum(n for s, n in sizes.items() if live[s][0] <= t <= live[s][1]) for t in range(6))


def test_the_order_of_first_use_where_that_needs_less():
    """Largest first needs 1,792 bytes here (the 768-byte buffer, placed first, splits the space
    the three buffers live together need); in order of first use, what is live at once at most."""
    sizes = {0: 768, 1: 512, 2: 512, 3: 512}
    live = {0: (3, 5), 1: (0, 5), 2: (1, 2), 3: (1, 1)}
    assert plan_memory(sizes, live).size == 1536


@pytest.mark.parametrize("seed", range(20))
def test_buffers_live_at_once_never_overlap(seed):
    rng = random.Random(seed)
    sizes = {s: rng.randrange(1, 4000) for s in range(rng.randrange(1, 40))}
    live = {}
    for s in sizes:
        first = rng.randrange(30)
        live[s] = (first, first + rng.randrange(10))
    plan = plan_memory(sizes, live)
    for a in sizes:
        assert plan.offsets[a] % ALIGNMENT == 0 and plan.offsets[a] + sizes[a] <= plan.size
        for b in sizes:
            if a < b and live[a][0] <= live[b][1] and live[b][0] <= live[a][1]:
                assert (plan.offsets[a] + sizes[a] <= plan.offsets[b] or plan.offsets[b] + sizes[b] <= plan.offsets[a])


def test_freed_space_is_reused():
    # 0 and 1 live together, 2 starts after 0 died: it takes 0's place
    plan = plan_memory({0: 1000, 1: 300, 2: 900}, {0: (0, 1), 1: (1, 2), 2: (2, 3)})
    assert plan.offsets == {0: 0, 1: 1024, 2: 0} and plan.size == 1024 + 512


def test_repeated_runs_allocate_only_the_outputs(monkeypatch):
    graph = chain(n=6)
    compiled = graph.compile()
    workspace = compiled.workspaces[torch.device("cpu")]
    x = torch.randn(64, 64)
    first = compiled.run([x])[0]
    allocations, empty = [], torch.empty

    def counting(*args, **kwargs):
        allocations.append(args)
        return empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", counting)
    second = compiled.run([x])[0]
    monkeypatch.undo()
    assert len(allocations) == 1                     # the one output
    assert graph.compile() is compiled and compiled.workspaces[torch.device("cpu")] is workspace
    assert second.data_ptr() != first.data_ptr()     # results outlive the next run
    assert_close(second, first)


def test_kernels_run_through_compiled_task(monkeypatch):
    from kiln.runtime.backend import CompiledTask
    graph = chain(n=4)
    graph.compile()
    calls, original = [], CompiledTask.__call__

    def call(self, *args, **kwargs):
        calls.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(CompiledTask, "__call__", call)
    graph.run([torch.randn(64, 64)])
    assert len(calls) == len(graph.nodes) == 6


def test_missing_input_is_reported():
    x, y = kiln.symbol((4,), "float32", "cpu"), kiln.symbol((4,), "float32", "cpu")
    z = kiln.ops.add(x, y)
    graph = kiln.FlowGraph([z], [x], [z.trace[0]])
    with pytest.raises(ValueError, match="neither one of its inputs"):
        graph.compile()


@pytest.mark.cuda
def test_cuda_graph_replay_through_compiled_graph_matches_plain_run():
    graph = chain(n=8, shape=(256, 256), device="cuda")
    compiled = graph.compile()
    assert_plan_sound(compiled)
    assert compiled.workspace_bytes < compiled.intermediate_bytes
    workspace = compiled.workspaces[torch.device("cuda", 0)].data_ptr()
    captured = graph.cuda_graph()
    for _ in range(2):
        x = torch.randn(256, 256, device="cuda")
        replayed = captured.run([x])[0].torch().clone()
        plain = graph.run([x])[0].torch()
        assert_close(replayed, plain)
        assert_close(replayed, interpret(graph, [x])[0])
    assert compiled.workspaces[torch.device("cuda", 0)].data_ptr() == workspace


@pytest.mark.cuda
def test_captures_of_a_device_share_one_workspace():
    """Two graphs captured one after the other keep their intermediates in one buffer, as large as
    the larger needs, and replays of either, interleaved, give the plain runs' values."""
    small = chain(n=4, shape=(256, 256), device="cuda")
    large = chain(n=8, shape=(512, 512), device="cuda")
    first, second, third = large.cuda_graph(), small.cuda_graph(), large.cuda_graph()
    assert first._order is second._order is third._order, "the later captures fit in the first's workspace"
    for _ in range(2):
        a, b = torch.randn(512, 512, device="cuda"), torch.randn(256, 256, device="cuda")
        replayed = [first.run([a], copy=True)[0].torch(), second.run([b], copy=True)[0].torch(),
                    third.run([a], copy=True)[0].torch()]
        assert_close(replayed[0], large.run([a])[0].torch())
        assert_close(replayed[1], small.run([b])[0].torch())
        assert_close(replayed[2], replayed[0])


@pytest.mark.parametrize("seed", range(20))
def test_buffers_in_freed_inputs_never_overlap_live_memory(seed):
    """`plan_with_regions`: a buffer goes into an input's memory only after the input's last read,
    inside it, never where a buffer live at the same time is; outputs go into inputs or nowhere."""
    rng = random.Random(seed)
    sizes = {s: rng.randrange(1, 4000) for s in range(rng.randrange(1, 40))}
    live = {}
    for s in sizes:
        first = rng.randrange(30)
        live[s] = (first, first + rng.randrange(10))
    regions = [[(0, rng.randrange(100, 9000), rng.randrange(30))] for _ in range(rng.randrange(1, 6))]
    outputs = [s for s in sizes if rng.random() < 0.3]
    for s in outputs:
        live[s] = (live[s][0], 40)
    plan, placed = plan_with_regions(sizes, live, regions, outputs)
    assert not set(outputs) & set(plan.offsets)
    assert set(plan.offsets) | set(placed) == set(sizes) - (set(outputs) - set(placed))
    where = {s: ("workspace", o) for s, o in plan.offsets.items()} | {s: r for s, r in placed.items()}
    for s, (region, offset) in placed.items():
        [(_, nbytes, last)] = regions[region]
        assert live[s][0] > last and offset % ALIGNMENT == 0 and offset + sizes[s] <= nbytes
    for a in sizes:
        for b in sizes:
            if a < b and a in where and b in where and where[a][0] == where[b][0] and \
                    live[a][0] <= live[b][1] and live[b][0] <= live[a][1]:
                oa, ob = where[a][1], where[b][1]
                assert oa + sizes[a] <= ob or ob + sizes[b] <= oa


def test_a_run_puts_values_in_an_input_it_has_read():
    """Given an input's memory after its last read (a consuming backward's saved values), a run
    puts intermediates and outputs there: the results are unchanged, the output needs no
    allocation of its own, and the workspace and outputs take less memory."""
    compiled = chain(n=6).compile()
    x = torch.randn(64, 64)
    expected = compiled.run([x.clone()])[0]
    slot, cpu = compiled.inputs[0], torch.device("cpu")
    layout = lent_layout({slot: x})
    placed = compiled.placed_in_inputs(frozenset(), layout)
    assert compiled.outputs[0] in placed and len(placed) >= 2
    out_bytes = 64 * 64 * 4
    assert compiled.plans_with(frozenset(), layout)[cpu].size < compiled.plans[cpu].size + out_bytes
    workspace = compiled.workspace_set(reused={slot: x})
    out = compiled.run([x], workspace)[0]
    assert_close(out, expected)
    assert x.data_ptr() <= out.data_ptr() < x.data_ptr() + x.nbytes
    x.copy_(torch.randn(64, 64))
    assert_close(compiled.run([x.clone()])[0], compiled.run([x], workspace)[0])


def test_parts_of_a_region_free_at_once_hold_a_buffer_larger_than_each():
    """`plan_with_regions`: two inputs side by side in one stretch of memory (a forward's saved
    values allocated together), once both are read, hold a buffer larger than either; an input
    read later keeps its part, and bytes between parts are never given out."""
    part = 4 * ALIGNMENT
    sizes, live = {0: 2 * part, 1: part}, {0: (5, 9), 1: (2, 9)}
    # parts at 0 and `part` read by steps 3 and 4; a gap of one part, then a part read at step 8
    region = [(0, part, 3), (part, part, 4), (3 * part, part, 8)]
    plan, placed = plan_with_regions(sizes, live, [region], outputs=[0])
    assert placed[0] == (0, 0)
    # slot 1, written at step 2 while the first two parts are still read, and barred from the
    # gap and the part read later, goes to the workspace
    assert 1 in plan.offsets and 1 not in placed
    # apart, the two parts could not hold slot 0
    _, apart = plan_with_regions(sizes, live, [[(0, part, 3)], [(0, part, 4)]], outputs=[0])
    assert 0 not in apart


def test_outputs_allocated_together_lie_side_by_side_in_write_order():
    """`workspace_set(together=...)`: a run allocates those outputs as views of one block, in
    the order it writes them, and computes the same values."""
    x = kiln.symbol((64, 64), "float32", "cpu")
    a = kiln.ops.tanh(x)
    b = kiln.ops.mul(a, 0.5)
    c = kiln.ops.add(b, 1.0)
    compiled = kiln.trace_from([c, a, b], [x]).compile()
    inp = torch.randn(64, 64)
    expected = compiled.run([inp])
    workspace = compiled.workspace_set(together=compiled.outputs)
    got = compiled.run([inp], workspace)
    for g, e in zip(got, expected):
        assert_close(g, e)
    storages = {t.untyped_storage().data_ptr() for t in got}
    assert len(storages) == 1
    # written a, then b, then c
    assert got[1].data_ptr() < got[2].data_ptr() < got[0].data_ptr()
    start = got[1].untyped_storage().data_ptr()
    assert all((t.data_ptr() - start) % ALIGNMENT == 0 for t in got)


def test_a_run_puts_a_value_across_two_inputs_that_lie_side_by_side():
    """Inputs that are slices of one block (`lent_layout`: a training forward's saved values
    allocated together) give a run their memory as one stretch once both are read: an output
    twice the size of each goes there, and the results are unchanged."""
    x = kiln.symbol((32, 64), "float32", "cpu")
    y = kiln.symbol((32, 64), "float32", "cpu")
    s = kiln.ops.add(kiln.ops.tanh(x), kiln.ops.tanh(y))
    out = kiln.ops.tanh(kiln.ops.concat([s, s], 0))
    compiled = kiln.trace_from(out, [x, y]).compile()
    block = torch.randn(2 * 32 * 64)
    a, b = block[:32 * 64].view(32, 64), block[32 * 64:].view(32, 64)
    expected = compiled.run([a.clone(), b.clone()])[0]
    reused = dict(zip(compiled.inputs, [a, b]))
    placed = compiled.placed_in_inputs(frozenset(), lent_layout(reused))
    assert compiled.outputs[0] in placed
    # apart (each its own storage), neither input holds the output
    apart = {slot: t.clone() for slot, t in reused.items()}
    assert compiled.outputs[0] not in compiled.placed_in_inputs(frozenset(), lent_layout(apart))
    got = compiled.run([a, b], compiled.workspace_set(reused=reused))[0]
    assert_close(got, expected)
    assert block.data_ptr() <= got.data_ptr() < block.data_ptr() + block.nbytes
