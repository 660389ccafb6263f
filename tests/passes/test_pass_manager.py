"""The pass manager: PassContext gating, instruments, composition of pipelines."""
import io

import pytest
import torch

import kiln
from kiln.passes import (
    DumpGraph, EliminateDeadCode, PassContext, PassTiming, PrintGraph, Sequential, graph_pass,
)


def _chain():
    x = kiln.symbol([4, 3])
    return kiln.trace_from(kiln.ops.neg(kiln.ops.relu(x)))


@graph_pass("count_nodes", opt_level=2)
def count_nodes(graph, ctx):
    count_nodes.seen.append(len(graph.nodes))
    return graph


count_nodes.seen = []


def test_opt_level_required_and_disabled_passes():
    count_nodes.seen.clear()
    g = _chain()
    with PassContext(opt_level=1):
        count_nodes(g)
    assert count_nodes.seen == []
    with PassContext(opt_level=1, required_passes=["count_nodes"]):
        count_nodes(g)
    assert count_nodes.seen == [2]
    with PassContext(opt_level=3, disabled_passes=["count_nodes"]):
        count_nodes(g)
    assert count_nodes.seen == [2]
    with PassContext(opt_level=2):
        count_nodes(g)
    assert count_nodes.seen == [2, 2]


def test_contexts_nest_inherit_and_reject_unknown_config():
    timing = PassTiming()
    with PassContext(opt_level=0, disabled_passes=["x"], instruments=[timing]) as outer:
        with PassContext(config={"use_fp16": True}) as inner:
            assert PassContext.current() is inner and inner.config["use_fp16"]
            assert inner.opt_level == 0 and inner.disabled_passes == {"x"}
            assert inner.instruments == [timing]
            with PassContext(opt_level=3, config={"use_fp16_reduction": True}) as innermost:
                assert innermost.opt_level == 3
                assert innermost.config["use_fp16"] and innermost.config["use_fp16_reduction"]
                assert kiln.settings.current().use_fp16 and kiln.settings.current().use_fp16_reduction
        assert PassContext.current() is outer and "use_fp16" not in outer.config
        assert not kiln.settings.current().use_fp16, "the config changes settings while entered"
    assert PassContext.current().opt_level == 2
    with pytest.raises(KeyError, match="use_fp32"):
        PassContext(config={"use_fp32": True})


def test_instruments_print_time_and_dump(tmp_path):
    out = io.StringIO()
    timing = PassTiming()
    pipeline = Sequential([EliminateDeadCode(), count_nodes], name="mine")
    with PassContext(instruments=[PrintGraph(before=False, file=out), timing, DumpGraph(str(tmp_path))]):
        pipeline(_chain())
    text = out.getvalue()
    assert "# after eliminate_dead_code\nGraph(x: float32[4, 3][cpu])" in text
    assert "# after mine" in text and "# before" not in text
    assert [name for name, _ in timing.timings] == ["eliminate_dead_code", "count_nodes", "mine"]
    assert all(sec >= 0 for _, sec in timing.timings) and "count_nodes" in timing.render()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["00_input.txt", "01_eliminate_dead_code.txt", "02_count_nodes.txt", "03_mine.txt"]
    assert "Relu" in (tmp_path / "02_count_nodes.txt").read_text()
    with PassContext(instruments=[DumpGraph(str(tmp_path / "two"))]):
        EliminateDeadCode()(_chain())
        EliminateDeadCode()(_chain())
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == [
        "00_input.txt", "01_eliminate_dead_code.txt", "02_input.txt", "03_eliminate_dead_code.txt"]


def test_optimize_keeps_inputs_and_output_order():
    a, b = kiln.symbol([3]), kiln.symbol([3])
    unused = kiln.symbol([2])
    s = kiln.ops.add(a, b)
    graph = kiln.trace_from([kiln.ops.relu(s), b, s], [unused, b, a])
    opt = kiln.graph.optimize(graph)
    assert [t is u for t, u in zip(opt.inputs, graph.inputs)] == [True] * 3
    assert opt.outputs[1] is b
    va, vb = torch.randn(3), torch.randn(3)
    got = opt.run([torch.zeros(2), vb, va])
    want = graph.run([torch.zeros(2), vb, va])
    for g, w in zip(got, want):
        torch.testing.assert_close(g.torch(), w.torch())
