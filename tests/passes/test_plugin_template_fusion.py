"""A plugin's element-wise operator with a template of its own fuses with its element-wise
neighbours (issue 34): `i0(abs x) + 2 * i0(-x)` is one auto-scheduled kernel, as it is without
the template (it was five: each i0 an anchor that no neighbour could join), and the template
still computes an i0 that stays alone."""
from __future__ import annotations

import math
import types

import pytest
import torch

import kiln
from kiln import ops
from kiln.graph import operator
from kiln.ir import compute
from kiln.plugins import hookimpl, registry, reload
from kiln.template import CDialect, CpuProgram, KernelArgs, Template, dtypes

TERMS = 24


@operator("i0")
def i0(x):
    """The modified Bessel function of the first kind, order 0, by its power series."""
    def value(*i):
        quarter_square, term, total = x[i] * x[i] / 4.0, 1.0, 1.0
        for k in range(1, TERMS):
            term = term * quarter_square / (k * k)
            total = total + term
        return total
    return compute(x.shape, value)


rendered: list[str] = []


def render_i0(task):
    """One C loop over the elements, summing the series term by term."""
    rendered.append(task.name)
    (x,), _ = task.inputs, task.outputs
    params = ", ".join(KernelArgs.params(CDialect(), task.inputs, task.outputs))
    source = (f"#include <stdint.h>\nvoid i0_series({params}) {{\n"
              f"    for (int64_t e = 0; e < {math.prod(x.shape)}; ++e) {{\n"
              f"        float q = {KernelArgs.input(0)}[e] * {KernelArgs.input(0)}[e] / 4.0f, term = 1.0f, sum = 1.0f;\n"
              f"        for (int k = 1; k < {TERMS}; ++k) {{ term *= q / (float)(k * k); sum += term; }}\n"
              f"        {KernelArgs.output(0)}[e] = sum;\n    }}\n}}\n")
    return CpuProgram(source, "i0_series", tuple(KernelArgs.args(1, 1)))


I0_CPU = Template("i0_cpu", ("i0",), "cpu", render_i0,
                  applies=lambda task: task.inputs[0].dtype == dtypes.float32)


@pytest.fixture
def i0_plugin():
    plugin = types.SimpleNamespace(kiln_operators=hookimpl(lambda: [i0]), kiln_schedules=hookimpl(lambda: [I0_CPU]))
    registry().add_plugin("i0_plugin", plugin, "kiln-i0")
    yield
    reload()


def test_a_plugin_operator_with_a_template_fuses_with_its_elementwise_neighbours(i0_plugin):
    x = kiln.symbol([4, 8])
    graph = kiln.trace_from(ops.i0(ops.abs(x)) + 2 * ops.i0(ops.neg(x)))
    opt = kiln.graph.optimize(graph)
    assert len(opt.nodes) == 1, opt
    value = torch.randn(4, 8)
    rendered.clear()
    torch.testing.assert_close(opt.run([value])[0].torch(),
                               torch.special.i0(value.abs()) + 2 * torch.special.i0(-value))
    assert rendered == [], "the fused kernel is the auto-scheduler's"


def test_a_chain_that_starts_at_the_templated_operator_is_one_kernel(i0_plugin):
    x = kiln.symbol([4, 8])
    opt = kiln.graph.optimize(kiln.trace_from(ops.i0(x) * 2 + 1, [x]))
    assert len(opt.nodes) == 1, opt
    value = torch.randn(4, 8)
    torch.testing.assert_close(opt.run([value])[0].torch(), torch.special.i0(value) * 2 + 1)


def test_the_template_computes_an_i0_that_stays_alone(i0_plugin):
    x = kiln.symbol([4, 8])
    alone = kiln.graph.optimize(kiln.trace_from(ops.i0(x), [x]))
    assert [n.definition.name for n in alone.nodes] == ["i0"]
    value = torch.randn(4, 8)
    rendered.clear()
    torch.testing.assert_close(alone.run([value])[0].torch(), torch.special.i0(value))
    assert rendered == ["i0"]
