"""Fused kernels on CUDA. Without a GPU: graphs of symbolic CUDA tensors are optimized (nothing
runs), every fused group compiles with NVRTC for sm_80 and sm_90, and a matmul with its
epilogue still gets the matmul templates. With a GPU: optimized graphs match PyTorch."""
import pytest
import torch

import kiln
from kiln.passes import FusedOperator, FuseOperators
from kiln.runtime import cuda as rt
from tests.passes.passes_support import apply, const

ops = kiln.ops

needs_nvrtc = pytest.mark.skipif(not rt.nvrtc_available(), reason="cuda-bindings / nvidia-cuda-nvrtc "
                                 "not installed: pip install 'kiln-core[cuda]'")


def _cpu_groups():
    x, y = kiln.symbol([4, 8]), kiln.symbol([8])
    chain = ops.tanh(ops.mul(ops.relu(ops.add(x, y)), 2.0))
    h = ops.relu(ops.add(ops.matmul(ops.mul(ops.neg(x), 0.5), const(8, 4)), 1.0))
    sm = ops.exp(ops.softmax(h, -1))
    img = kiln.symbol([1, 2, 6, 6])
    conv = ops.relu(ops.add(ops.conv2d(img, const(2, 2, 3, 3), const(2), padding=1), img))
    return kiln.trace_from([chain, sm, h, conv], [x, y, img])


def _cuda_linear_block(dtype):
    x, w, b = (kiln.symbol(s, dtype, "cuda") for s in ([64, 64], [64, 64], [64]))
    return kiln.trace_from(ops.relu(ops.add(ops.matmul(ops.neg(x), w), b)), [x, w, b])


@needs_nvrtc
def test_fused_groups_compile_with_nvrtc():
    from kiln.schedule.choose import check_nvrtc
    fused = [n for n in apply(FuseOperators(), _cpu_groups()).nodes if isinstance(n, FusedOperator)]
    # the CPU GEMM templates take matmul and conv2d, so the matmul's prologue stays apart
    assert [n.name for n in fused] == ["FusedAdd", "FusedNeg", "FusedMatmul", "FusedSoftmax", "FusedConv2d"]
    for node in fused:
        check_nvrtc(node.task, ("sm_80", "sm_90"))


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_matmul_epilogue_keeps_its_templates(dtype):
    from kiln.schedule import schedules_for
    a, b = kiln.symbol([64, 64], dtype, "cuda"), kiln.symbol([64, 64], dtype, "cuda")
    plain = [t.name for t in schedules_for(ops.matmul(a, b).trace[0].task, "cuda")]
    opt = kiln.graph.optimize(_cuda_linear_block(dtype))
    neg, fused = opt.nodes                       # a prologue would cost the templates: kept apart
    assert neg.name == "Neg" and repr(fused.fused_graph) == "FlowGraph(Matmul, Add, Relu)"
    assert fused.task.name == "matmul" and plain
    assert [t.name for t in schedules_for(fused.task, "cuda")] == plain


@needs_nvrtc
def test_matmul_epilogue_renders_into_the_template_with_nvrtc():
    from kiln.schedule.choose import check_nvrtc
    fused = kiln.graph.optimize(_cuda_linear_block("float32")).nodes[1]
    check_nvrtc(fused.task, ("sm_80", "sm_90"))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_matmul_epilogue_matches_on_gpu(dtype):
    x, w, b = (torch.randn(s, dtype=dtype, device="cuda") for s in ([64, 64], [64, 64], [64]))
    opt = kiln.graph.optimize(_cuda_linear_block(str(dtype).replace("torch.", "")))
    assert len(opt.nodes) == 2
    tol = 2e-2 if dtype == torch.float16 else 1e-4
    torch.testing.assert_close(opt(x, w, b).torch(), torch.relu(-x @ w + b), atol=tol, rtol=tol)


@pytest.mark.cuda
def test_prologue_epilogue_and_softmax_match_on_gpu():
    w = torch.randn(8, 4, device="cuda")
    x = kiln.symbol([4, 8], device="cuda")
    h = ops.relu(ops.add(ops.matmul(ops.mul(ops.neg(x), 0.5), kiln.from_torch(w)), 1.0))
    opt = kiln.graph.optimize(kiln.trace_from(ops.exp(ops.softmax(h, -1))))
    v = torch.randn(4, 8, device="cuda")
    expected = torch.exp(torch.softmax(torch.relu((-v * 0.5) @ w + 1.0), -1))
    torch.testing.assert_close(opt(v).torch(), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("vocabulary", [50, 64])
def test_a_weights_cast_is_written_as_the_weight_lies_and_the_gemm_reads_its_transpose(vocabulary):
    """A linear under autocast, cast(w).t() @ ..: the cast alone writes w's layout (a row
    kernel, not a strided transpose) and the transpose joins the matmul as the prologue its
    TMA template reads, instead of the cast writing the transpose for the GEMM to stage back
    (GPT-2's LM head: 142 + 75 us before a GEMM three times slower, on the H200)."""
    from kiln.schedule.choose import choose
    x = kiln.symbol([4, 16, 32], "bfloat16", "cuda")
    w = kiln.symbol([vocabulary, 32], "float32", "cuda")
    y = ops.matmul(x, ops.permute(ops.cast(w, "bfloat16"), [1, 0]))
    cast, fused = kiln.graph.optimize(kiln.trace_from([y], [x, w])).nodes
    assert cast.name == "Cast" and tuple(cast.outputs[0].shape) == (vocabulary, 32)
    assert repr(fused.fused_graph) == "FlowGraph(Permute, Matmul)"
    assert choose(fused.task, "cuda", 90).kernel_names == ["kiln_matmul_sm90"]
    assert choose(cast.task, "cuda", 90).kernel_names != ["kiln_transpose"]
