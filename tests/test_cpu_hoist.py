"""Costly parts of a reduction's body that are the same for several elements of its buffer are
computed once, into temporaries (`kiln.schedule.hoist`, in the CPU loop nests): attention's
exp(scores - max), which its output's reduction over keys computed again for every value
dimension, also after a transpose and reshape merged heads and value dims."""
import re

import torch
import torch.nn.functional as F

import kiln
from kiln.ir.inline import inline_task
from kiln.schedule.choose import auto_program
from kiln.schedule.hoist import hoist_invariants

ops = kiln.ops


def _last_loop_nest(source: str) -> str:
    """The C of the loop nest writing the output (the last one of the kernel)."""
    body = source[source.index("void kiln_kernel"):]
    return body[[m.start() for m in re.finditer(r"#pragma omp parallel for", body)][-1]:]


def test_attention_exponentials_are_computed_once_per_score():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 8, 37, 16), torch.randn(2, 2, 37, 16), torch.randn(2, 2, 37, 24)
    mask = torch.randn(37, 37)
    syms = [kiln.symbol(list(t.shape)) for t in (q, k, v, mask)]
    merged = ops.reshape(ops.transpose(ops.attention(*syms), 1, 2), (2, 37, 8 * 24))
    graph = kiln.graph.optimize(kiln.trace_from(merged, syms))
    (node,) = graph.nodes
    source = auto_program(node.task, "cpu").source
    assert "expf(" not in _last_loop_nest(source)
    assert len(hoist_invariants(inline_task(node.task)).temporaries) == len(inline_task(node.task).temporaries) + 1
    expected = F.scaled_dot_product_attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), mask)
    torch.testing.assert_close(graph(q, k, v, mask).torch(), expected.transpose(1, 2).reshape(2, 37, 192),
                               atol=1e-5, rtol=1e-5)


def _sum_over_j(inner):
    """sum_j inner(x, w)[i, j, e] for x [5, 33], w [33, 7], as one fused kernel."""
    sx, sw = kiln.symbol([5, 33]), kiln.symbol([33, 7])
    graph = kiln.graph.optimize(kiln.trace_from(ops.sum(inner(sx, sw), 1), [sx, sw]))
    (node,) = graph.nodes
    return graph, node


def test_a_part_shared_by_a_row_is_hoisted_and_one_of_each_element_is_not():
    torch.manual_seed(1)
    x, w = torch.randn(5, 33), torch.randn(33, 7)
    shared, node = _sum_over_j(lambda a, b: ops.mul(ops.unsqueeze(ops.exp(a), 2), ops.unsqueeze(b, 0)))
    assert len(hoist_invariants(inline_task(node.task)).temporaries) == 1
    assert "expf(" not in _last_loop_nest(auto_program(node.task, "cpu").source)
    torch.testing.assert_close(shared(x, w).torch(), (torch.exp(x)[:, :, None] * w[None]).sum(1), atol=1e-5, rtol=1e-5)
    own, node = _sum_over_j(lambda a, b: ops.exp(ops.mul(ops.unsqueeze(a, 2), ops.unsqueeze(b, 0))))
    assert not hoist_invariants(inline_task(node.task)).temporaries
    torch.testing.assert_close(own(x, w).torch(), torch.exp(x[:, :, None] * w[None]).sum(1), atol=1e-5, rtol=1e-5)
