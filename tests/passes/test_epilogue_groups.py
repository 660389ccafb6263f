"""Template epilogues take whole element-wise groups (`kiln.passes.fusion`): a chain that fans out
from a linear's result and meets again (GELU written out, as GPT-2's), and a residual stream's
sum whose first addition reads other values (a pre-norm block's R + A + F). On the CPU, whose
GEMM template renders the same epilogues through its C hooks; a gather's bounds check stays out
of them (the C hooks cannot report it). The same groups on CUDA compile with NVRTC."""
import math

import pytest
import torch

import kiln
from kiln.passes import FusedOperator, FuseOperators
from kiln.runtime import cuda as rt
from tests.passes.passes_support import apply, const, run_both

ops = kiln.ops


def gelu_tanh(x):
    """GELU's tanh form as transformers' NewGELUActivation writes it: x read three times."""
    inner = ops.mul(ops.add(x, ops.mul(ops.pow(x, 3.0), 0.044715)), math.sqrt(2.0 / math.pi))
    return ops.mul(ops.mul(x, 0.5), ops.add(ops.tanh(inner), 1.0))


def pre_norm_tail(r, a, h, w, b):
    """A pre-norm block's end: the residual after attention (R + A) feeds the second norm and,
    with the MLP's output F, the next residual (R + A) + F."""
    mid = ops.add(r, a)
    return ops.add(mid, ops.linear(h, w, b)), ops.layer_norm(mid, [mid.shape[-1]])


def kernels(graph) -> list:
    return [n for n in graph.nodes if n.name != "Constant"]


def test_a_chain_that_fans_out_joins_the_linear():
    x = kiln.symbol([3, 7, 24])
    graph = kiln.trace_from(gelu_tanh(ops.linear(x, const(40, 24), const(40))), [x])
    opt = apply(FuseOperators(), graph)
    (fused,) = kernels(opt)
    members = [n.definition.name for n in fused.fused_graph.nodes]
    assert isinstance(fused, FusedOperator) and members[0] == "linear" and {"pow", "tanh"} <= set(members)
    run_both(graph, opt, torch.randn(3, 7, 24), atol=1e-4, rtol=1e-4)


def test_a_residual_sum_joins_the_linear_it_ends_with():
    r, a, h = kiln.symbol([2, 9, 16]), kiln.symbol([2, 9, 16]), kiln.symbol([2, 9, 48])
    graph = kiln.trace_from(list(pre_norm_tail(r, a, h, const(16, 48), const(16))), [r, a, h])
    opt = kiln.graph.optimize(graph)
    linear = next(n for n in kernels(opt) if "linear" in [m.definition.name for m in n.fused_graph.nodes])
    assert [m.definition.name for m in linear.fused_graph.nodes] == ["add", "linear", "add"]
    assert len(kernels(opt)) == 2                     # the linear with the sum, the layer norm with its own
    run_both(graph, opt, torch.randn(2, 9, 16), torch.randn(2, 9, 16), torch.randn(2, 9, 48), atol=1e-4, rtol=1e-4)


def test_a_bounds_checked_gather_stays_out_of_cpu_template_epilogues():
    ids, x = kiln.symbol([2, 5], "int64"), kiln.symbol([2, 5, 12])
    table = const(30, 8)
    graph = kiln.trace_from(ops.add(ops.embedding(ids, table), ops.linear(x, const(8, 12))), [ids, x])
    opt = kiln.graph.optimize(graph)
    for node in kernels(opt):
        names = [m.definition.name for m in node.fused_graph.nodes] if isinstance(node, FusedOperator) else []
        assert not ("embedding" in names and "linear" in names)
    good = torch.randint(0, 30, (2, 5))
    run_both(graph, opt, good, torch.randn(2, 5, 12), atol=1e-4, rtol=1e-4)
    bad = good.clone()
    bad[1, 3] = 30
    with pytest.raises(IndexError):
        opt.run([bad, torch.randn(2, 5, 12)])


@pytest.mark.skipif(not rt.nvrtc_available(), reason="cuda-bindings / nvidia-cuda-nvrtc not installed")
def test_the_groups_compile_for_cuda():
    from kiln.schedule.choose import choose
    sym = lambda *shape, dt="float16": kiln.symbol(list(shape), dt, "cuda")
    ids, table, r, a = sym(2, 64, dt="int64"), sym(50, 64), sym(2, 64, 64), sym(2, 64, 64)
    w1, w2, b2 = sym(128, 64), sym(64, 128), sym(64)
    start = ops.add(ops.embedding(ids, table), r)                  # the gather joins a CUDA epilogue
    outs = pre_norm_tail(start, a, gelu_tanh(ops.linear(a, w1)), w2, b2)
    opt = kiln.graph.optimize(kiln.trace_from(list(outs), [ids, table, r, a, w1, w2, b2]))
    programs = [choose(n.task, "cuda", 90) for n in kernels(opt)]
    assert len(programs) == 3                 # linear + GELU; embedding + R + A + linear; layer norm
    rt.compile_many([(p.source, f"group{k}", p.arch_for("sm_90")) for k, p in enumerate(programs)])
