"""Fusion composes one Task for groups of the same structure (`kiln.passes.fused.group_key`): the
identical layers of a model share their fused Tasks, so the templates that take a Task are
matched once for all layers, however many there are; groups that differ (in how their members
read each other, here) get Tasks of their own."""
import torch

import kiln
import kiln.schedule.session as session_module
from kiln.passes import FusedOperator, FuseOperators
from tests.passes.passes_support import apply, const, run_both

ops = kiln.ops


def layers(count: int):
    """`count` identical residual blocks, h + relu(linear(h)), each with its own weights."""
    x = kiln.symbol([4, 6, 32])
    h = x
    for _ in range(count):
        h = ops.add(h, ops.relu(ops.linear(h, const(32, 32), const(32))))
    return kiln.trace_from(h, [x])


def fused_nodes(graph) -> list[FusedOperator]:
    return [n for n in graph.nodes if isinstance(n, FusedOperator)]


def matched(graph, monkeypatch) -> tuple[object, list]:
    """(`graph` fused, the tasks whose templates were matched meanwhile)."""
    asked = []
    original = session_module.schedules_for

    def counting(task, *args, **kwargs):
        asked.append(task)
        return original(task, *args, **kwargs)
    monkeypatch.setattr(session_module, "schedules_for", counting)
    opt = apply(FuseOperators(), graph)
    monkeypatch.setattr(session_module, "schedules_for", original)
    return opt, asked


def test_identical_layers_share_their_fused_task_and_its_template_match(monkeypatch):
    two, asked_two = matched(layers(2), monkeypatch)
    graph = layers(6)
    six, asked_six = matched(graph, monkeypatch)
    fused = fused_nodes(six)
    assert len(fused) == 6 and len({id(n.task) for n in fused}) == 1
    assert fused[0].task is fused_nodes(two)[0].task
    assert len(asked_six) == len(asked_two)          # not one match more for four more layers
    run_both(graph, six, torch.randn(4, 6, 32), atol=1e-4, rtol=1e-4)


def test_groups_whose_members_read_each_other_differently_have_tasks_of_their_own():
    x = kiln.symbol([4, 6, 32])
    c = const(4, 6, 32)
    first = ops.sub(ops.relu(ops.linear(x, const(32, 32), const(32))), c)
    second = ops.sub(c, ops.relu(ops.linear(first, const(32, 32), const(32))))   # operands swapped
    graph = kiln.trace_from(second, [x])
    opt = apply(FuseOperators(), graph)
    a, b = fused_nodes(opt)
    assert [m.definition.name for m in a.fused_graph.nodes] == [m.definition.name for m in b.fused_graph.nodes]
    assert a.fused_graph.nodes[-1].task is b.fused_graph.nodes[-1].task     # one subtraction task
    assert a.task is not b.task
    run_both(graph, opt, torch.randn(4, 6, 32), atol=1e-4, rtol=1e-4)
