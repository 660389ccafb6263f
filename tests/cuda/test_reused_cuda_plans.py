"""A CUDA plan traced at one sequence length serves others (`kiln.frontend.torch.plan_reuse`),
without a GPU: a GPT-2-like model's plan (programs, buffers, steps) traced at s0 = 40 reads its
size's value only through guards; bound to each length where they hold it is the plan traced
fresh there, kernel sources and launches alike; the guards fail from 64 on and at 32 and below
(thresholds and power-of-two buckets of the templates' choices): at 200, the plan traced there
differs. Traced at 160, where attention takes the Hopper template (more than 128 keys), the
plan again reads nothing but guards and serves 129 to 255."""
from kiln.graph.compile import graph_slots, is_view
from kiln.ir.size import guards_hold
from kiln.ir.size_reads import recording
from kiln.runtime.compiled_graph import View
from kiln.runtime.plan_binding import bound
from kiln.schedule.choose import choose

from tests.cuda.symbolic_cases import gpt_block


def _plan(length: int):
    """The size reads and the plan (each node's program, then `graph_slots`) of `gpt_block`
    traced at `length` for an sm_90 GPU."""
    with recording() as reads:
        graph = gpt_block(length)
        programs = [View() if is_view(node, graph) else choose(node.task, "cuda", 90) for node in graph.nodes]
        return reads, (programs, *graph_slots(graph))


def test_a_cuda_plan_traced_at_one_length_is_the_fresh_plan_wherever_its_guards_hold():
    reads, plan = _plan(40)
    assert reads.read is None
    names = {type(p).__name__ for p in plan[0]}
    assert "CudaProgram" in names
    for length in (33, 47, 63):
        assert guards_hold(reads.guards, {"s0": length})
        assert bound(plan, {"s0": length}) == bound(_plan(length)[1], None)
    crossed = [length for length in (17, 32, 64, 200) if not guards_hold(reads.guards, {"s0": length})]
    assert crossed == [17, 32, 64, 200]
    assert bound(plan, {"s0": 200}) != bound(_plan(200)[1], None)


def test_a_plan_with_hopper_attention_serves_the_lengths_of_its_bucket():
    # the template's tensor maps once took their strides with int(), a read of the size's value:
    # on the H200, GPT-2 traced at 160 then served no other length
    reads, plan = _plan(160)
    assert reads.read is None
    assert any("kiln_attention_sm90" in p.source for p in plan[0] if type(p).__name__ == "CudaProgram")
    for length in (129, 200, 255):
        assert guards_hold(reads.guards, {"s0": length})
        assert bound(plan, {"s0": length}) == bound(_plan(length)[1], None)
    assert not guards_hold(reads.guards, {"s0": 128})


def test_the_lengths_next_to_a_plans_thresholds_plan_the_neighbouring_lengths():
    """`plan_reuse.neighbours` of the plan traced at 96 (what `Settings.plan_ahead` traces after
    it): 64, the first length below 96's bucket, and 144, past the 128-key threshold of the
    Hopper attention. The plans traced there serve 64 alone (a template takes 64 rows or more)
    and 129-255, as fresh traces would."""
    from kiln.frontend.torch.plan_reuse import ReusablePlan, neighbours
    reads, plan = _plan(96)
    reusable = ReusablePlan(None, frozenset(reads.guards), None, set(), frozenset({"s0"}))
    assert neighbours(reusable, {"s0": 96}) == [{"s0": 64}, {"s0": 144}]
    for ahead, served in ((64, (64,)), (144, (129, 160, 200, 255))):
        reads, plan = _plan(ahead)
        assert reads.read is None
        for length in served:
            assert guards_hold(reads.guards, {"s0": length})
            assert bound(plan, {"s0": length}) == bound(_plan(length)[1], None)
