"""Row tasks that write their statistics too (issue 32): a training layer norm's forward
(aten.native_layer_norm: the normalized rows, and the mean and 1 / std saved for the backward)
and RMSNorm's (the rows, and the 1 / rms its decomposition saves) are one row kernel, which
writes each statistic that is an output from the row's reduction, once a row
(`kiln.schedule.rows`). Before, the row scheduler took tasks of one output only: the layer
norm's forward was its row kernel and four more for the statistics, RMSNorm's two kernels.

On the CPU through torch.compile against PyTorch (the forward's three outputs and the
gradients, odd row counts and lengths, float32 and bfloat16, a non-contiguous input) with the
forward graph's kernels counted; on CUDA, graphs of symbolic tensors (nothing runs): the task
takes the row kernel, which compiles with NVRTC for sm_80 and sm_90."""
import pytest
import torch
import torch.nn as nn

import kiln
from kiln.frontend.torch import KilnFunction
from kiln.ir.inline import inline_task
from kiln.runtime import cuda as rt
from kiln.schedule.choose import auto_program
from kiln.schedule.rows import row_task

ops = kiln.ops
aten = torch.ops.aten
pytestmark = pytest.mark.usefixtures("fresh_dynamo")
needs_nvrtc = pytest.mark.skipif(not rt.nvrtc_available(), reason="cuda-bindings / nvidia-cuda-nvrtc "
                                 "not installed: pip install 'kiln-core[cuda]'")

SHAPES = [(1, 17), (7, 1), (33, 768), (7, 1000), (1, 1), (33, 17)]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def layer_norm_with_statistics(x, w, b):
    return aten.native_layer_norm(x, [x.shape[-1]], w, b, 1e-5)


def compiled_forward(fn, *inputs):
    """fn(*inputs) compiled by Kiln for training (every input needs a gradient), and the
    FlowGraph that ran its forward."""
    before = set(KilnFunction.live())
    out = torch.compile(fn, backend="kiln")(*inputs)
    (new,) = [f for f in KilnFunction.live() if f not in before]
    (run,) = new.graphs.values()
    return out, run.graph


def leaves(*tensors):
    return [t.detach().clone().requires_grad_(True) for t in tensors]


def check_training(fn, inputs, tol):
    """fn's outputs (a tuple) and the gradients of the inputs through its first output, Kiln
    against eager; the FlowGraph of Kiln's forward."""
    got_in, want_in = leaves(*inputs), leaves(*inputs)
    got, graph = compiled_forward(fn, *got_in)
    want = fn(*want_in)
    weights = torch.randn(want[0].shape).to(want[0].dtype)
    (got[0].float() * weights).sum().backward()
    (want[0].float() * weights).sum().backward()
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=tol, atol=tol)
    for g, w in zip(got_in, want_in):     # rows of one element: eager's x - mean is not always 0
        torch.testing.assert_close(g.grad, w.grad, rtol=tol, atol=tol * max(1.0, w.grad.abs().max().item()) + 1e-4)
    return graph


def row_kernels(graph) -> list[str]:
    """The CPU program of each node of `graph`: 'rows' for the row kernel, else 'loops'."""
    return ["rows" if "for (int64_t e = 0;" in auto_program(n.task, "cpu").source else "loops"
            for n in graph.nodes]


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("rows, width", SHAPES)
def test_layer_norm_forward_and_statistics_are_one_row_kernel(rows, width, dtype):
    torch.manual_seed(rows * width)
    x = torch.randn(rows, width).to(dtype)
    w, b = torch.randn(width).to(dtype), torch.randn(width).to(dtype)
    graph = check_training(layer_norm_with_statistics, (x, w, b), TOLERANCE[dtype])
    assert len(graph.nodes) == 1, [n.name for n in graph.nodes]
    assert row_kernels(graph) == ["rows"]


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_layer_norm_backward_is_a_row_kernel_and_the_parameters_column_sums(dtype):
    """The backward: the input's gradient one row kernel, the weight's and the bias's a sum over
    the rows each. The normalized input, which the row kernel and the weight's gradient both
    read, is computed in each (`kiln.passes.recompute`): before, it was a kernel of its own, as
    were the output's gradient times the weight and, for bfloat16, the input's cast."""
    torch.manual_seed(0)
    norm = nn.LayerNorm(768).to(dtype)
    nn.init.normal_(norm.weight)
    x = torch.randn(4, 33, 768).to(dtype).requires_grad_(True)
    y = torch.compile(norm, backend="kiln")(x)
    before = set(KilnFunction.live())
    (y.float() * torch.randn(y.shape)).sum().backward()
    (new,) = [f for f in KilnFunction.live() if f not in before]
    (run,) = new.graphs.values()
    assert len(run.graph.nodes) == 3, [n.name for n in run.graph.nodes]
    assert sorted(row_kernels(run.graph)) == ["loops", "loops", "rows"]


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_non_contiguous_input_and_batch_dims(dtype):
    """x a transposed view of (3, 11, 37) rows of 37; nn.LayerNorm's forward (its statistics
    are saved for the backward, not returned): one row kernel either way."""
    torch.manual_seed(0)
    x = torch.randn(37, 11, 3).to(dtype).permute(2, 1, 0)
    assert not x.is_contiguous()
    w, b = torch.randn(37).to(dtype), torch.randn(37).to(dtype)
    graph = check_training(layer_norm_with_statistics, (x, w, b), TOLERANCE[dtype])
    assert len(graph.nodes) == 1 and row_kernels(graph) == ["rows"]
    norm = nn.LayerNorm(37).to(dtype)
    graph = check_training(lambda x: (norm(x),), (x,), TOLERANCE[dtype])
    assert len(graph.nodes) == 1 and row_kernels(graph) == ["rows"]


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("rows, width", [(7, 1), (33, 768), (1, 1000)])
def test_rms_norm_forward_is_one_row_kernel(rows, width, dtype):
    """nn.RMSNorm in training decomposes to x * rsqrt(mean(x^2) + eps) * w, saving the rsqrt."""
    torch.manual_seed(width)
    norm = nn.RMSNorm(width, eps=1e-6).to(dtype)
    nn.init.normal_(norm.weight)
    graph = check_training(lambda x: (norm(x),), (torch.randn(rows, width).to(dtype),), TOLERANCE[dtype])
    assert len(graph.nodes) == 1, [n.name for n in graph.nodes]
    assert row_kernels(graph) == ["rows" if width > 1 else "loops"]     # a mean of one element is no reduction


def _cuda_graphs(rows: int, n: int, dtype: str):
    """Row groups with statistic outputs on CUDA: name -> optimized graph."""
    x, w, b = kiln.symbol([rows, n], dtype, "cuda"), kiln.symbol([n], dtype, "cuda"), kiln.symbol([n], dtype, "cuda")
    wide = ops.cast(x, "float32")
    mean = ops.mean(wide, [1], True)
    centered = ops.sub(wide, mean)
    rstd = ops.rsqrt(ops.add(ops.mean(ops.mul(centered, centered), [1], True), 1e-5))
    layer_norm = ops.cast(ops.add(ops.mul(ops.mul(centered, rstd), w), b), dtype)
    scale = ops.rsqrt(ops.add(ops.mean(ops.mul(wide, wide), [1], True), 1e-6))
    rms_norm = ops.mul(ops.cast(ops.mul(wide, scale), dtype), w)
    built = {"layer_norm": ([layer_norm, mean, rstd], [x, w, b]), "rms_norm": ([scale, rms_norm], [x, w]),
             "layer_norm_statistics_cast": ([layer_norm, ops.cast(mean, dtype), ops.cast(rstd, dtype)], [x, w, b])}
    return {k: kiln.graph.optimize(kiln.trace_from(outs, ins)) for k, (outs, ins) in built.items()}


@pytest.mark.parametrize("n", (33, 768, 4096))
def test_cuda_statistic_outputs_take_the_row_kernel(n):
    """One node; its CUDA program one kernel `kiln_row`, whose row's first thread writes each
    statistic output."""
    for name, graph in _cuda_graphs(70, n, "bfloat16").items():
        (node,) = graph.nodes
        lowered = inline_task(node.task)
        out, _ = row_task(lowered)
        assert len(lowered.outputs) > 1 and out.shape == (70, n), name
        program = auto_program(node.task, "cuda")
        assert program.kernel_names == ["kiln_row"], name
        assert program.source.count("== 0) out") == len(lowered.outputs) - 1, name


@needs_nvrtc
@pytest.mark.parametrize("dtype", ("float32", "bfloat16"))
def test_cuda_statistic_outputs_compile_with_nvrtc(dtype):
    jobs = []
    for n in (1, 33, 1000, 4096):
        for name, graph in _cuda_graphs(70, n, dtype).items():
            program = auto_program(graph.nodes[0].task, "cuda")
            jobs += [(program.source, f"{name}_{n}", arch) for arch in ("sm_80", "sm_90")]
    rt.compile_many(jobs, workers=2)
