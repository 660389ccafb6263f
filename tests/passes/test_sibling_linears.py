"""MergeSiblingLinears: linears sharing an input become one linear and a split, same values."""
import torch

import kiln
from kiln.passes import PassContext, PassInstrument
from kiln_ops_builtin.passes.sibling_linears import MergeSiblingLinears
from tests.passes.passes_support import apply, const, names, run_both

ops = kiln.ops


def test_query_key_value_projections_become_one_linear():
    x = kiln.symbol([2, 5, 12])
    q, k, v = (ops.linear(x, const(n, 12), const(n)) for n in (8, 8, 4))   # unequal widths
    out = ops.add(ops.sum(ops.matmul(q, ops.transpose(k, -1, -2)), -1, keepdim=True), ops.relu(v))
    graph = kiln.trace_from(out)
    opt = apply(MergeSiblingLinears(), graph)
    assert names(graph).count("Linear") == 3
    assert names(opt).count("Linear") == 1 and names(opt).count("Split") == 1
    merged = next(n for n in opt.nodes if n.name == "Linear")
    assert merged.outputs[0].shape == (2, 5, 20)
    run_both(graph, opt, torch.randn(2, 5, 12), atol=1e-5, rtol=1e-5)


def test_what_is_not_merged():
    x, y = kiln.symbol([3, 8]), kiln.symbol([3, 8])
    w_input = kiln.symbol([6, 8])
    outs = [ops.linear(x, const(6, 8), const(6)),     # with a bias ...
            ops.linear(x, const(5, 8)),               # ... and without: no siblings
            ops.linear(y, const(6, 8)),               # another input
            ops.linear(x, w_input)]                   # a weight that is no constant
    graph = kiln.trace_from(outs, [x, y, w_input])
    opt = apply(MergeSiblingLinears(), graph)
    assert names(opt) == names(graph)


def test_models_get_one_projection_and_the_pass_can_be_disabled():
    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v = (torch.nn.Linear(16, 16) for _ in range(3))

        def forward(self, x):
            return torch.softmax(self.q(x) @ self.k(x).transpose(-1, -2), -1) @ self.v(x)

    model, x = Attention().eval(), torch.randn(2, 7, 16)
    with torch.no_grad():
        want = model(x)
        for disabled, linears in (([], 1), (["merge_sibling_linears"], 3)):
            torch._dynamo.reset()
            seen = []
            with PassContext(disabled_passes=disabled, instruments=[_Count(seen)]):
                got = torch.compile(model, backend="kiln")(x)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            assert seen[-1] == linears


class _Count(PassInstrument):
    """Records the number of linear operators after constant folding (which runs right after
    the merge, whether or not the merge is enabled)."""

    def __init__(self, seen):
        self.seen = seen

    def run_after_pass(self, graph, graph_pass):
        if graph_pass.name == "fold_constants":
            self.seen.append(sum(n.definition.name == "linear" for n in graph.nodes))
