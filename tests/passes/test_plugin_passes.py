"""Passes, rewrite patterns and the attention operator arriving from a plugin of their own."""
import types

import pytest
import torch

import kiln
from kiln.ir import compute, exp, reduce
from kiln.passes import PassContext, default_pipeline, graph_pass, op, rewrite_pattern, wildcard
from kiln.passes.pipeline import PassError
from kiln.plugins import hookimpl, registry, reload
from kiln_ops_builtin.patterns import attention as attention_patterns
from tests.passes.passes_support import names, run_both

ops = kiln.ops


@kiln.operator("attention", override=True)
def attention(q, k, v, mask=None, scale=None):
    """softmax(q @ k^T * scale + mask) @ v over the last two dims of 3-D tensors."""
    b, n, d = q.shape
    m = k.shape[1]

    def score(i, j, r):
        s = reduce([d], lambda t: q[i, j, t] * k[i, r, t]) * scale
        return s + mask[i, j, r] if mask is not None else s

    scores = compute((b, n, m), score)
    top = compute((b, n), lambda i, j: reduce([m], lambda r: scores[i, j, r], op="max"))
    total = compute((b, n), lambda i, j: reduce([m], lambda r: exp(scores[i, j, r] - top[i, j])))
    return compute((b, n, v.shape[2]), lambda i, j, c: reduce(
        [m], lambda r: exp(scores[i, j, r] - top[i, j]) * v[i, r, c]) / total[i, j])


_x = wildcard()


@rewrite_pattern("neg_neg", op("neg", op("neg", _x)))
def neg_neg(m):
    """-(-x) is x."""
    return m[_x]


@graph_pass("count_runs", opt_level=1)
def count_runs(graph, ctx):
    count_runs.runs += 1
    return graph


count_runs.runs = 0

plugin = types.SimpleNamespace(
    kiln_operators=hookimpl(lambda: [attention]),
    kiln_graph_passes=hookimpl(lambda: [count_runs]),
    kiln_rewrite_patterns=hookimpl(lambda: [neg_neg]),
)


@pytest.fixture
def with_plugin():
    registry().add_plugin("test_passes_plugin", plugin)
    yield
    reload()


def test_plugin_pass_and_pattern_run_in_optimize(with_plugin):
    x = kiln.symbol([5])
    graph = kiln.trace_from(ops.relu(ops.neg(ops.neg(x))))
    before = count_runs.runs
    opt = kiln.graph.optimize(graph)
    assert count_runs.runs == before + 1
    assert names(opt) == ["Relu"]
    run_both(graph, opt, torch.randn(5))
    with PassContext(disabled_passes=["neg_neg", "count_runs"]):
        kept = kiln.graph.optimize(graph)
    assert count_runs.runs == before + 1 and names(kept) == ["FusedNeg"]


@pytest.mark.parametrize("masked", [False, True])
def test_attention_pattern_uses_the_plugin_operator(with_plugin, masked):
    q, k, v = kiln.symbol([2, 3, 4]), kiln.symbol([2, 5, 4]), kiln.symbol([2, 5, 6])
    mask = kiln.from_torch(torch.randn(2, 3, 5))
    scores = ops.div(ops.matmul(q, ops.transpose(k, -2, -1)), 2.0)
    if masked:
        scores = ops.add(mask, scores)
    graph = kiln.trace_from(ops.matmul(ops.softmax(scores, -1), v), [q, k, v])
    opt = kiln.graph.optimize(graph)
    assert names(opt) == ["Attention"]
    assert opt.nodes[0].attrs["scale"] == 0.5
    run_both(graph, opt, torch.randn(2, 3, 4), torch.randn(2, 5, 4), torch.randn(2, 5, 6))


def test_without_an_attention_operator_the_pattern_declines(monkeypatch):
    monkeypatch.setattr(attention_patterns, "provided", lambda name: None)
    q, v = kiln.symbol([1, 2, 3]), kiln.symbol([1, 2, 3])
    scores = ops.mul(ops.matmul(q, ops.transpose(q, 1, 2)), 0.5)
    graph = kiln.trace_from(ops.matmul(ops.softmax(scores, -1), v), [q, v])
    with PassContext(disabled_passes=["fuse_operators"]):
        opt = kiln.graph.optimize(graph)
    assert names(opt) == ["Transpose", "Matmul", "Mul", "Softmax", "Matmul"]


def test_a_wildcard_condition_picks_the_commutative_order():
    """`wildcard(where=...)` binds the input that satisfies it, whichever side of a commutative
    operator it is on; where neither does, the pattern does not match."""
    row, other = wildcard(where=lambda t: t.shape[0] == 1), wildcard()
    pattern = rewrite_pattern("row_product", op("mul", other, row, commutative=True))(lambda m: None)
    a, b = kiln.symbol([1, 4]), kiln.symbol([3, 4])
    for product in (kiln.ops.mul(a, b), kiln.ops.mul(b, a)):
        found = pattern.match(product.trace[0], {}, set())
        assert found[row] is a and found[other] is b
    assert pattern.match(kiln.ops.mul(b, b).trace[0], {}, set()) is None


@graph_pass("after_precision", stage="precision")
def after_precision(graph, ctx):
    return graph


@graph_pass("nowhere", stage="somewhere")
def nowhere(graph, ctx):
    return graph


def _pipeline_names(*passes) -> list[str]:
    plugin = types.SimpleNamespace(kiln_graph_passes=hookimpl(lambda: list(passes)))
    registry().add_plugin("staged_passes_plugin", plugin, "kiln-staged-passes")
    return [p.name for p in default_pipeline().passes]


@pytest.fixture
def restore_plugins():
    yield
    reload()


def test_plugin_passes_run_at_the_end_of_their_stage(restore_plugins):
    """A plugin pass runs at the end of the stage it declares (kiln.passes.graph_pass.STAGES);
    kiln-ops-builtin's passes declare theirs."""
    at = _pipeline_names(after_precision).index
    assert at("rewrite_subgraphs") < at("merge_sibling_linears") < at("fold_constants")
    assert at("allow_tf32") < at("after_precision") < at("plan_layout")
    assert at("plan_layout") < at("space_to_depth") < at("zero_filters") < at("fold_channel_gates") \
        < at("recompute_cheap_producers")


def test_a_plugin_pass_of_an_unknown_stage_is_named_with_its_plugin(restore_plugins):
    with pytest.raises(PassError, match=r"graph pass 'nowhere' of plugin kiln-staged-passes declares the stage "
                                        r"'somewhere'; the pipeline's stages are simplify, precision, layout"):
        _pipeline_names(nowhere)
