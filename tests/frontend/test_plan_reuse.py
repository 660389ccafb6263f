"""A new size of a graph dynamo traced with symbolic sizes runs the plan traced at an earlier size
(`kiln.frontend.torch.plan_reuse`), on the CPU: the same plan and the same outputs as a fresh
trace at that size; a rule's decision that flips with the size, or a read of a size's value,
makes the size trace anew."""
import pytest
import torch
import torch.nn.functional as F
import transformers

import kiln
from kiln.frontend.torch import register_function
from kiln.frontend.torch.backend import KilnFunction
from kiln.runtime.plan_binding import bound
pytestmark = pytest.mark.usefixtures("fresh_dynamo", "no_nvrtc_check")


@pytest.fixture
def rule():
    """Register a rule for F.silu (removed after the test)."""
    registry, added = kiln.torch.mapping_registry(), []

    def register(handler):
        register_function(F.silu, priority=1000)(handler)
        added.append(handler)
    yield register
    for handler in added:
        registry.remove(F.silu, handler=handler)


def _same_plan(a, b) -> bool:
    a, b = bound(a, None), bound(b, None)
    return (a.kernels == b.kernels and a.steps == b.steps and a.buffers == b.buffers and a.inputs == b.inputs
            and a.outputs == b.outputs and a.constants.keys() == b.constants.keys()
            and all(torch.equal(a.constants[k], b.constants[k]) for k in a.constants))


def test_new_lengths_of_gpt2_run_the_first_symbolic_plan_as_a_fresh_trace_would(traced):
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=2, n_positions=64)
    model = transformers.GPT2LMHeadModel(config).eval()
    compiled = torch.compile(model, backend="kiln", options={"graph_cache": False})
    lengths, outputs = (5, 8, 11, 30, 9), {}
    with torch.no_grad():
        for length in lengths:
            ids = torch.randint(0, 64, (2, length))
            outputs[length] = (ids, compiled(ids, use_cache=False).logits)
            torch.testing.assert_close(outputs[length][1], model(ids, use_cache=False).logits, atol=1e-4, rtol=1e-4)
        assert len([s for s in traced if s]) == 1, traced     # the first symbolic length's trace serves the others
        function, = [f for f in KilnFunction.live() if f._reusable]
        plans = {length: run.record.plan for length, run in zip(lengths[1:], function.graphs.values())}
        for length in lengths[2:]:
            function.release()
            ids, reused = outputs[length]
            assert torch.equal(compiled(ids, use_cache=False).logits, reused)
            fresh, = function.graphs.values()
            assert _same_plan(fresh.record.plan, plans[length])
    assert len([s for s in traced if s]) == 1 + len(lengths[2:])


def test_a_decision_that_flips_with_the_size_is_not_reused_across_the_flip(traced, rule):
    """A rule that computes silu on rows longer than 8 and doubles shorter ones: each side of 8
    has its plan, and a size is served by the plan of its own side."""
    def by_width(x, inplace=False):
        return kiln.ops.silu(x) if x.shape[-1] > 8 else kiln.ops.mul(x, 2.0)
    rule(by_width)
    compiled = torch.compile(lambda x: F.silu(x) + 1, backend="kiln", dynamic=True)
    for width in (10, 12, 5, 6, 20, 3, 9, 8):
        x = torch.randn(3, width)
        want = (F.silu(x) if width > 8 else x * 2) + 1
        torch.testing.assert_close(compiled(x), want)
    assert [sorted(s.values()) for s in traced] == [[3, 10], [3, 5]]


def test_a_size_whose_value_the_trace_read_traces_every_new_size(traced, rule):
    """A rule that scales by the row length as a float (a read of the size's value, not a
    comparison): no plan serves another size."""
    def scaled(x, inplace=False):
        return kiln.ops.mul(x, float(x.shape[-1]))
    rule(scaled)
    compiled = torch.compile(lambda x: F.silu(x) + 1, backend="kiln", dynamic=True)
    for width in (10, 12, 5):
        x = torch.randn(3, width)
        torch.testing.assert_close(compiled(x), x * width + 1)
    assert [sorted(s.values()) for s in traced] == [[3, 10], [3, 12], [3, 5]]


def test_planning_ahead_traces_the_sizes_past_a_flip_with_the_first_symbolic_trace(traced, rule):
    """With `plan_ahead`, the first trace (width 12, rows fixed) traces the width next to the
    rule's flip too (8, a multiple of 12's power-of-two divisor 4): every later width, on
    either side, binds one of the two plans."""
    def by_width(x, inplace=False):
        return kiln.ops.silu(x) if x.shape[-1] > 8 else kiln.ops.mul(x, 2.0)
    rule(by_width)
    compiled = torch.compile(lambda x: F.silu(x) + 1, backend="kiln", options={"plan_ahead": "always"})
    for width in (12, 10, 5, 6, 20, 3, 9, 8):
        x = torch.randn(3, width)
        torch._dynamo.mark_dynamic(x, 1)
        want = (F.silu(x) if width > 8 else x * 2) + 1
        torch.testing.assert_close(compiled(x), want)
    assert [list(s.values()) for s in traced] == [[12], [8]]


def test_the_neighbours_of_a_plan_are_the_nearest_sizes_its_guards_refuse():
    from kiln.frontend.torch.plan_reuse import ReusablePlan, neighbours
    from kiln.ir.size import SymSize
    from kiln.ir.size_reads import recording
    with recording() as reads:
        s = SymSize.named("s0", 96)
        assert s > 64 and not s > 128 and (s * 3) % 2 == 0
    plan = ReusablePlan(None, frozenset(reads.guards), None, set(), frozenset({"s0"}))
    assert neighbours(plan, {"s0": 96}) == [{"s0": 64}, {"s0": 144}]     # steps of 16
    assert neighbours(plan, {"s0": 100}) == [{"s0": 64}, {"s0": 132}]    # steps of 4
    assert neighbours(plan, {"s0": 96, "s1": 3}) == []


def test_sizes_moved_to_other_values_keep_their_expressions():
    from kiln.frontend.torch.plan_reuse import sizes_at
    from kiln.ir.size import SymSize, size_text
    s, t = SymSize.named("s0", 10), SymSize.named("s1", 3)
    moved = sizes_at([(2, s * t, (s + 1) // 2), s, "other"], {"s0": 7})
    assert [int(d) for d in moved[0]] == [2, 21, 4] and int(moved[1]) == 7 and moved[2] == "other"
    assert [size_text(d) for d in moved[0]] == [size_text(d) for d in (2, s * t, (s + 1) // 2)]


def test_neighbours_are_looked_for_within_a_factor_of_the_traced_size():
    from kiln.frontend.torch.plan_reuse import REACH, ReusablePlan, neighbours
    from kiln.ir.size import SymSize
    from kiln.ir.size_reads import recording
    with recording() as reads:
        s = SymSize.named("s0", 64)
        assert s * 4096 < 2 ** 31 and s > 4
    plan = ReusablePlan(None, frozenset(reads.guards), None, set(), frozenset({"s0"}))
    assert neighbours(plan, {"s0": 64}) == []          # 4 is below 64 / REACH, 2 ** 19 above 64 * REACH
    assert neighbours(plan, {"s0": 12}) == [{"s0": 4}]
    assert neighbours(plan, {"s0": 2 ** 16}) == [{"s0": 2 ** 19}] and 2 ** 19 <= 2 ** 16 * REACH


def test_neighbours_stay_within_the_sizes_dynamos_graph_takes():
    """dynamo's guards bound a size (here 5-99: a branch on it and a slice to 100); a neighbour
    outside would be traced for a graph dynamo never calls with it."""
    from kiln.frontend.torch.plan_reuse import ReusablePlan, neighbours
    from kiln.frontend.torch.sizes import size_ranges
    from kiln.ir.size import SymSize
    from kiln.ir.size_reads import recording
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    x = torch.randn(2, 8)
    torch._dynamo.mark_dynamic(x, 1)
    torch.compile(lambda x: x[:, :100].sum(1) if x.shape[1] > 4 else x, backend=capture)(x)
    ranges = size_ranges(graphs[0])
    assert list(ranges.values()) == [(5, 99)]
    name, = ranges
    with recording() as reads:
        assert SymSize.named(name, 12) > 4
    plan = ReusablePlan(None, frozenset(reads.guards), None, set(), frozenset({name}))
    assert neighbours(plan, {name: 12}) == [{name: 4}]
    assert neighbours(plan, {name: 12}, ranges) == []


def test_a_neighbour_served_by_its_own_plan_alone_is_planned_with_its_sizes_compiled_in(traced, rule):
    """Issue 33: a size whose plan serves no size next to it (GPT-2's 64 rows on an H200: the
    GEMM template's least rows and a bucket's top) runs kernels with the size compiled in,
    which the same plan with the size read at run time was 6.8% slower than. With `plan_ahead`,
    the first trace (width 12) traces the rule's one special width (8) ahead, symbolically,
    finds that its plan serves 8 alone, and traces 8 again with the sizes compiled in."""
    from kiln.ir.size import SymSize
    from kiln.runtime.plan_binding import symbolic_parts

    def at_eight(x, inplace=False):
        return kiln.ops.mul(x, 2.0) if x.shape[-1] == 8 else kiln.ops.silu(x)
    rule(at_eight)
    compiled = torch.compile(lambda x: F.silu(x) + 1, backend="kiln", options={"plan_ahead": "always"})
    for width in (12, 8, 10, 8, 7, 9):
        x = torch.randn(3, width)
        torch._dynamo.mark_dynamic(x, 1)
        torch.testing.assert_close(compiled(x), (x * 2 if width == 8 else F.silu(x)) + 1)
    assert [list(s.values()) for s in traced] == [[12], [8], []]
    function, = [f for f in KilnFunction.live() if f._reusable]
    twelve, eight = [p for p, _, _ in function._reusable]
    name, = eight.names
    assert eight.serves({name: 8}, eight.settings) and not twelve.serves({name: 8}, twelve.settings)
    assert not any(eight.serves({name: w}, eight.settings) for w in (7, 9, 12))
    assert symbolic_parts(twelve.record.plan) and not symbolic_parts(eight.record.plan)
    assert not any(isinstance(d, SymSize) for b in eight.record.plan.buffers for d in b.shape)


def test_a_plan_serving_its_size_alone_is_told_from_one_serving_a_range():
    from kiln.frontend.torch.plan_reuse import ReusablePlan
    from kiln.ir.size import SymSize
    from kiln.ir.size_reads import recording

    def plan(check, value):
        with recording() as reads:
            check(SymSize.named("s0", value))
        return ReusablePlan(None, frozenset(reads.guards), None, set(), frozenset({"s0"}))
    assert plan(lambda s: s >= 64 and s <= 64, 64).serves_one_size({"s0": 64})
    assert plan(lambda s: s >= 64 and s < 65, 64).serves_one_size({"s0": 64})
    assert not plan(lambda s: s > 48 and not s > 64, 64).serves_one_size({"s0": 64})  # 63 too
    assert not plan(lambda s: s > 32 and not s > 64, 64).serves_one_size({"s0": 64})  # 48 too
    assert not plan(lambda s: s >= 64 and s % 2 == 0, 64).serves_one_size({"s0": 64})  # 80
    assert not plan(lambda s: s == 64, 64).serves_one_size({"s0": 64, "s1": 3})
