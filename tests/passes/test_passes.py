"""Each pass: its structural effect, and the same values before and after, on the CPU."""
import torch

import kiln
from kiln.passes import (
    ConvertToFloat16, EliminateCommonSubexpressions, EliminateDeadCode, FoldConstants,
    FusedOperator, FuseOperators, RewriteSubgraphs,
)
from kiln.ir import compute, inline_task, reduce
from tests.passes.passes_support import apply, const, names, run_both

ops = kiln.ops


def test_dead_code_elimination():
    x = kiln.symbol([5])
    y = ops.relu(x)
    graph = kiln.FlowGraph([y], [x], [ops.neg(x).trace[0], y.trace[0]])
    opt = apply(EliminateDeadCode(), graph)
    assert names(graph) == ["Neg", "Relu"] and names(opt) == ["Relu"]
    run_both(graph, opt, torch.randn(5))


def test_common_subexpression_elimination():
    x = kiln.symbol([4, 3])
    a, b = ops.exp(x), ops.exp(x)
    graph = kiln.trace_from(ops.add(ops.relu(a), ops.relu(b)))
    opt = apply(EliminateCommonSubexpressions(), graph)
    assert names(graph) == ["Exp", "Relu", "Exp", "Relu", "Add"]
    assert names(opt) == ["Exp", "Relu", "Add"]
    add = opt.nodes[-1]
    assert add.inputs[0] is add.inputs[1]
    run_both(graph, opt, torch.randn(4, 3))


def test_constant_folding_runs_weight_transposes_now():
    w, b = const(3, 4), const(3)
    x, w_input = kiln.symbol([2, 4]), kiln.symbol([3, 4])
    traced = kiln.trace_from(ops.add(ops.matmul(x, ops.transpose(w_input, 0, 1)), b), [x, w_input])
    traced.nodes[0].inputs[0] = w                   # bind the weight input to a constant
    graph = kiln.FlowGraph(traced.outputs, [x], traced.nodes)
    opt = apply(FoldConstants(), graph)
    assert names(graph) == ["Transpose", "Matmul", "Add"] and names(opt) == ["Matmul", "Add"]
    folded = opt.nodes[0].inputs[1]
    assert not folded.is_symbolic and torch.equal(folded.torch(), w.torch().t())
    run_both(graph, opt, torch.randn(2, 4))


def test_conv2d_batch_norm_folds_into_the_convolution():
    x = kiln.symbol([1, 2, 5, 5])
    w, bias = const(3, 2, 3, 3), const(3)
    mean, var = const(3), kiln.from_torch(torch.rand(3) + 0.5)
    gamma, beta = const(3), const(3)
    y = ops.batch_norm(ops.conv2d(x, w, bias, padding=1), mean, var, gamma, beta, eps=1e-3)
    graph = kiln.trace_from(ops.relu(y))
    opt = apply(RewriteSubgraphs(), graph)
    assert names(graph) == ["Conv2d", "BatchNorm", "Relu"] and names(opt) == ["Conv2d", "Relu"]
    assert opt.nodes[0].attrs["padding"] == 1
    run_both(graph, opt, torch.randn(1, 2, 5, 5), atol=1e-4, rtol=1e-4)


def test_consecutive_batch_norm_folds_compute_each_layer_once():
    x = kiln.symbol([1, 2, 4, 4])

    def block(h, c_in):
        h = ops.conv2d(h, const(2, c_in, 1, 1))
        return ops.relu(ops.batch_norm(h, const(2), kiln.from_torch(torch.rand(2) + 0.5)))

    graph = kiln.trace_from(block(block(x, 2), 2))
    opt = apply(RewriteSubgraphs(), graph)
    assert names(opt) == ["Conv2d", "Relu", "Conv2d", "Relu"]
    run_both(graph, opt, torch.randn(1, 2, 4, 4), atol=1e-4, rtol=1e-4)


def test_chained_rewrites_are_found_in_one_round(monkeypatch):
    """Each layer's match reads the layer before's rewritten output: all are found in the first
    round (built on the old tensors, moved onto the new ones by the rebuild), the second finds
    nothing left; before, each layer waited a round for the one before."""
    rounds = []
    found = RewriteSubgraphs._round
    monkeypatch.setattr(RewriteSubgraphs, "_round",
                        staticmethod(lambda graph, patterns: rounds.append(found(graph, patterns)) or rounds[-1]))
    x, w, b = kiln.symbol([2, 4]), kiln.symbol([4, 4]), kiln.symbol([4])
    h = x
    for _ in range(6):
        h = ops.relu(ops.add(b, ops.matmul(h, ops.transpose(w, 0, 1))))
    graph = kiln.trace_from(h, [x, w, b])
    opt = apply(RewriteSubgraphs(), graph)
    assert names(opt) == ["Linear", "Relu"] * 6
    assert [len(r) for r in rounds] == [6, 0]
    run_both(graph, opt, torch.randn(2, 4), torch.randn(4, 4) / 2, torch.randn(4), atol=1e-5, rtol=1e-5)


def test_linear_batch_norm_folds_into_the_layer():
    x = kiln.symbol([4, 3])
    y = ops.batch_norm(ops.linear(x, const(5, 3)), const(5), kiln.from_torch(torch.rand(5) + 0.5))
    graph = kiln.trace_from(y)
    opt = apply(RewriteSubgraphs(), graph)
    assert names(opt) == ["Linear"] and len(opt.nodes[0].inputs) == 3
    run_both(graph, opt, torch.randn(4, 3), atol=1e-4, rtol=1e-4)


def test_matmul_by_transposed_weight_plus_bias_is_one_linear():
    x, w, b = kiln.symbol([2, 4]), kiln.symbol([3, 4]), kiln.symbol([3])
    graph = kiln.trace_from(ops.add(b, ops.matmul(x, ops.transpose(w, 0, 1))), [x, w, b])
    opt = apply(RewriteSubgraphs(), graph)
    assert names(graph) == ["Transpose", "Matmul", "Add"] and names(opt) == ["Linear"]
    assert opt.nodes[0].inputs == [x, w, b]
    run_both(graph, opt, torch.randn(2, 4), torch.randn(3, 4), torch.randn(3))


def test_reshape_and_transpose_chains_collapse():
    x = kiln.symbol([2, 3, 4])
    r = ops.unsqueeze(ops.flatten(ops.reshape(x, [6, 4])), 0)          # 3 reshapes: one
    p = ops.transpose(ops.permute(x, [2, 0, 1]), 0, 2)                  # 2 permutes: one
    same = ops.transpose(ops.transpose(x, 0, 1), 1, 0)                  # identity: none
    graph = kiln.trace_from([r, p, ops.reshape(same, [2, 3, 4])], [x])
    opt = apply(RewriteSubgraphs(), graph)
    assert names(opt) == ["Reshape", "Permute"]
    assert opt.outputs[2] is x
    assert opt.nodes[1].attrs["dims"] == [1, 0, 2]
    run_both(graph, opt, torch.randn(2, 3, 4))


def test_elementwise_chain_is_one_kernel():
    x, y = kiln.symbol([4, 8]), kiln.symbol([8])
    graph = kiln.trace_from(ops.tanh(ops.mul(ops.relu(ops.add(x, y)), 2.0)))
    opt = apply(FuseOperators(), graph)
    assert len(graph.nodes) == 4 and len(opt.nodes) == 1
    fused = opt.nodes[0]
    assert isinstance(fused, FusedOperator) and fused.inputs == [x, y]
    assert repr(fused.fused_graph) == "FlowGraph(Add, Relu, Mul, Tanh)"
    assert fused.task.is_injective
    run_both(graph, opt, torch.randn(4, 8), torch.randn(8))


def test_epilogue_and_prologue_join_their_anchor():
    # the anchor is a reduction without a schedule template (a template-scheduled anchor, such
    # as matmul with the CPU GEMM templates, keeps its prologue apart: test_fused_cuda.py)
    x = kiln.symbol([3, 5])
    scaled = ops.mul(ops.neg(x), 0.5)                     # prologue of the sum
    h = ops.relu(ops.add(ops.sum(scaled, -1), 1.0))       # epilogue
    s = ops.softmax(h, -1)                                # a second anchor: its own group
    graph = kiln.trace_from([ops.exp(s), h])
    opt = apply(FuseOperators(), graph)
    assert names(opt) == ["FusedSum", "FusedSoftmax"]
    red, sm = opt.nodes
    assert repr(red.fused_graph) == "FlowGraph(Neg, Mul, Sum, Add, Relu)" and red.anchor == 2
    assert red.attrs["anchor"] == 2 and red.task.attrs["anchor_operator"] == "sum"
    assert red.task.name == "sum"                         # the reduction folded into the epilogue
    assert [b.has_reduce for b in inline_task(red.task).buffers] == [True]
    assert sm.task.name == "fused_softmax"
    assert repr(sm.fused_graph) == "FlowGraph(Softmax, Exp)" and sm.anchor == 0
    assert opt.outputs[1] is red.outputs[0]              # h is also a graph output
    run_both(graph, opt, torch.randn(3, 5))


def test_fusion_keeps_a_shared_intermediate_materialized_once():
    x = kiln.symbol([6])
    e = ops.exp(x)
    graph = kiln.trace_from([ops.add(ops.relu(e), ops.neg(e))])
    opt = apply(FuseOperators(), graph)
    assert names(opt) == ["FusedExp"]
    run_both(graph, opt, torch.randn(6))


@kiln.operator("naive_row_sum")
def naive_row_sum(x):
    """Sums rows in the input's own type (float16 for float16 inputs)."""
    return compute(x.shape[:1], lambda i: reduce([x.shape[1]], lambda k: x[i, k]))


def test_fp16_keeps_statistics_in_float32_and_the_signature():
    x, w = kiln.symbol([4, 8]), const(8, 8)
    h = ops.layer_norm(ops.matmul(x, w), [8])
    graph = kiln.trace_from(naive_row_sum(h))
    opt = apply(ConvertToFloat16(), graph, config={"use_fp16": True})
    by_name = {n.definition.name: n for n in opt.nodes}
    assert by_name["matmul"].outputs[0].dtype == kiln.dtypes.float16
    assert by_name["layer_norm"].outputs[0].dtype == kiln.dtypes.float16   # accumulates in float32 itself
    assert by_name["naive_row_sum"].inputs[0].dtype == kiln.dtypes.float32  # would sum in float16: kept
    assert opt.outputs[0].dtype == kiln.dtypes.float32 and opt.inputs == graph.inputs
    run_both(graph, opt, torch.randn(4, 8), atol=3e-2, rtol=3e-2)
    reduced = apply(ConvertToFloat16(), graph, config={"use_fp16": True, "use_fp16_reduction": True})
    assert {n.definition.name: n for n in reduced.nodes}["naive_row_sum"].inputs[0].dtype == kiln.dtypes.float16


def test_fp16_is_off_by_default():
    graph = kiln.trace_from(ops.relu(kiln.symbol([3])))
    assert apply(ConvertToFloat16(), graph) is graph


def test_fused_convolution_keeps_the_anchor_name_and_attributes():
    img = kiln.symbol([1, 2, 6, 6])
    y = ops.relu(ops.add(ops.conv2d(img, const(2, 2, 3, 3), const(2), padding=1), img))
    graph = kiln.trace_from(y)
    opt = apply(FuseOperators(), graph)
    (conv,) = opt.nodes
    assert conv.name == "FusedConv2d" and conv.task.name == "conv2d"
    assert conv.task.attrs["padding"] == 1 and conv.task.attrs["anchor"] == 0
    run_both(graph, opt, torch.randn(1, 2, 6, 6), atol=1e-5, rtol=1e-5)
