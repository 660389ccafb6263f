"""Row reductions fused with their producers and consumers: softmax (with a scale and a mask
add), log_softmax (of a cast), layer_norm (of a residual add and a bias), rms_norm, Llama's
RMSNorm written out (float32 and Hugging Face's bfloat16 form), and softmax and layer_norm
written out (two reductions each) are one kernel each, which computes every statistic once
per row (`kiln.schedule.rows`, `cpu_rows`, `cuda_rows`). Folding a row statistic into the
output (`kiln.passes.fused.fold_anchor`) used to compute it again for every element of its
row; written-out softmax and layer_norm were a kernel per reduction.

On the CPU through torch.compile against PyTorch (odd row lengths, non-contiguous inputs),
with the kernel's structure checked; on CUDA, graphs of symbolic tensors (nothing runs): the
row kernel's structure and its NVRTC compilation for sm_80 and sm_90."""
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import kiln
from kiln.ir.expr import Reduce, walk
from kiln.ir.inline import inline_task
from kiln.runtime import cuda as rt
from kiln.schedule.choose import auto_program
from tests.frontend.frontend_support import compile_and_compare

ops = kiln.ops
needs_nvrtc = pytest.mark.skipif(not rt.nvrtc_available(), reason="cuda-bindings / nvidia-cuda-nvrtc "
                                 "not installed: pip install 'kiln-core[cuda]'")


def llama_rms_norm(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def hand_softmax(x, m):
    e = torch.exp(x + m - (x + m).amax(-1, keepdim=True))
    return e / e.sum(-1, keepdim=True)


def hand_layer_norm(x, r, w):
    h = x + r
    d = h - h.mean(-1, keepdim=True)
    return d / torch.sqrt(d.pow(2).mean(-1, keepdim=True) + 1e-5) * w


def hf_llama_rms_norm(x, w):
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    return w * h.to(x.dtype)


# name: (function, input shapes for a row length n, statistics per row, tolerance)
CASES = {
    "softmax_scale_mask": (lambda x, m: torch.softmax(x * 0.125 + m, -1),
                           lambda n: [(2, 3, 5, n), (5, n)], 2, 1e-5),
    "log_softmax_of_cast": (lambda x: torch.log_softmax(x.float() * 2.0, -1),
                            lambda n: [("bfloat16", 6, n)], 2, 1e-4),
    "layer_norm_residual_bias": (lambda x, r, b, w, c: F.layer_norm(x + r + b, (x.shape[-1],), w, c),
                                 lambda n: [(4, 7, n), (4, 7, n), (n,), (n,), (n,)], 2, 1e-4),
    "rms_norm_residual": (lambda x, r, w: F.rms_norm(x + r, (x.shape[-1],), w, 1e-6),
                          lambda n: [(3, 9, n), (3, 9, n), (n,)], 1, 1e-4),
    "llama_rms_norm": (llama_rms_norm, lambda n: [(3, 9, n), (n,)], 1, 1e-4),
    "hf_llama_rms_norm_bf16": (hf_llama_rms_norm, lambda n: [("bfloat16", 3, 9, n), ("bfloat16", n)], 1, 2e-2),
    "hand_written_softmax": (hand_softmax, lambda n: [(4, 5, n), (5, n)], 2, 1e-5),
    "hand_written_layer_norm": (hand_layer_norm, lambda n: [(6, n), (6, n), (n,)], 2, 1e-4),
    # GPT-2's Conv1D flattens the normalized rows before its addmm: the reshape joins the row kernel
    "layer_norm_flattened": (lambda x, w, c: F.layer_norm(x, (x.shape[-1],), w, c).reshape(-1, x.shape[-1]),
                             lambda n: [(4, 7, n), (n,), (n,)], 2, 1e-4),
    "softmax_rows_regrouped": (lambda x: torch.softmax(x, -1).reshape(5, 3, 2, -1),
                               lambda n: [(2, 3, 5, n)], 2, 1e-5),
}
ROW_LENGTHS = (1, 37, 129, 1001)


class _Call(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *xs):
        return self.fn(*xs)


def _inputs(shapes):
    out = []
    for shape in shapes:
        dtype = getattr(torch, shape[0]) if isinstance(shape[0], str) else torch.float32
        dims = shape[1:] if isinstance(shape[0], str) else shape
        out.append(torch.randn(*dims).to(dtype))
    return out


def _compiled_nodes(fn, inputs, tol):
    capture, _ = compile_and_compare(_Call(fn), *inputs, atol=tol, rtol=tol)
    graph = next(iter(capture.compiled[0].graphs.values())).graph
    return [n for n in graph.nodes if n.name != "Constant"]


def _reduction_inits(source: str) -> int:
    return len(re.findall(r"\b(?:float|double) acc\d+ = ", source))


@pytest.mark.parametrize("n", ROW_LENGTHS)
@pytest.mark.parametrize("case", list(CASES))
def test_row_groups_match_torch_as_one_kernel(case, n):
    fn, shapes, _, tol = CASES[case]
    torch.manual_seed(n)
    nodes = _compiled_nodes(fn, _inputs(shapes(n)), tol)
    assert len(nodes) == 1, [node.name for node in nodes]


@pytest.mark.parametrize("case", list(CASES))
def test_each_statistic_is_computed_once_per_row(case):
    """The fused task keeps each reduction a temporary of its own (the output reads it, and
    holds no reduction itself), and the C kernel reduces before its loop over the row's
    elements, never inside it."""
    fn, shapes, stats, tol = CASES[case]
    torch.manual_seed(0)
    (node,) = _compiled_nodes(fn, _inputs(shapes(129)), tol)
    lowered = inline_task(node.task)
    assert len(lowered.temporaries) == stats
    assert not any(isinstance(x, Reduce) for x in walk(lowered.outputs[0].value))
    source = auto_program(node.task, "cpu").source
    body = source[source.index("void kiln_kernel"):]
    assert "malloc" not in body                                    # statistics stay in locals
    assert body.count("for (int64_t e = 0; e < 129; ++e)") == 1    # the loop writing the row
    before, element_loop = body.split("for (int64_t e = 0; e < 129; ++e)")
    assert _reduction_inits(before) == stats and _reduction_inits(element_loop) == 0


@pytest.mark.parametrize("case", ["softmax_scale_mask", "layer_norm_residual_bias", "llama_rms_norm"])
def test_non_contiguous_inputs(case):
    """The normalized input as a transposed view and as a strided slice."""
    fn, shapes, stats, tol = CASES[case]
    torch.manual_seed(1)
    shape = shapes(37)[0]
    transposed = torch.randn(*shape[:-2], shape[-1], shape[-2]).transpose(-1, -2)
    strided = torch.randn(*shape[:-1], 2 * shape[-1])[..., ::2]
    for first in (transposed, strided):
        assert not first.is_contiguous()
        (node,) = _compiled_nodes(fn, [first] + _inputs(shapes(37)[1:]), tol)
        assert len(inline_task(node.task).temporaries) == stats


def test_only_one_to_one_reads_of_a_reduction_are_folded():
    """A row statistic read by every element of its row stays a temporary (folding it would
    reduce again for each element); a reduction read once per output element is folded."""
    x = kiln.symbol([6, 10])
    broadcast = ops.mul(x, ops.sum(x, -1, keepdim=True))
    (node,) = kiln.graph.optimize(kiln.trace_from(broadcast, [x])).nodes
    lowered = inline_task(node.task)
    assert len(lowered.temporaries) == 1
    assert not any(isinstance(e, Reduce) for e in walk(lowered.outputs[0].value))
    per_element = ops.mul(ops.sum(x, -1), 2.0)
    (node,) = kiln.graph.optimize(kiln.trace_from(per_element, [x])).nodes
    lowered = inline_task(node.task)
    assert node.task.name == "sum" and not lowered.temporaries


def _cuda_graphs(n: int, dtype: str):
    """The CUDA row groups (70 rows of n elements): name -> (graph, statistics per row)."""
    def sym(*shape, dt=dtype):
        return kiln.symbol(list(shape), dt, "cuda")

    x, r, m, w, b = sym(70, n), sym(70, n), sym(70, n), sym(n), sym(n)
    softmax = ops.softmax(ops.add(ops.mul(x, 0.125), m), -1)
    log_softmax = ops.log_softmax(ops.mul(ops.cast(x, "float32"), 2.0), -1)
    layer_norm = ops.layer_norm(ops.add(ops.add(x, r), b), (n,), w, b)
    rms_norm = ops.rms_norm(ops.add(x, r), (n,), w, 1e-6)
    llama = ops.mul(ops.mul(x, ops.rsqrt(ops.add(ops.mean(ops.pow(x, 2), -1, True), 1e-6))), w)
    shifted = ops.exp(ops.sub(x, ops.amax(x, -1, True)))
    hand_softmax = ops.div(shifted, ops.sum(shifted, -1, True))
    deviation = ops.sub(x, ops.mean(x, -1, True))
    variance = ops.mean(ops.mul(deviation, deviation), -1, True)
    hand_layer_norm = ops.mul(deviation, ops.rsqrt(ops.add(variance, 1e-5)))
    built = {"softmax": (softmax, [x, m], 2), "log_softmax": (log_softmax, [x], 2),
             "layer_norm": (layer_norm, [x, r, b, w], 2), "rms_norm": (rms_norm, [x, r, w], 1),
             "llama_rms_norm": (llama, [x, w], 1), "hand_written_softmax": (hand_softmax, [x], 2),
             "hand_written_layer_norm": (hand_layer_norm, [x], 2)}
    return {k: (kiln.graph.optimize(kiln.trace_from(y, ins)), s) for k, (y, ins, s) in built.items()}


@pytest.mark.parametrize("n", (33, 768, 4096))
def test_cuda_row_groups_are_one_row_kernel(n):
    """One node, one kernel `kiln_row`, one lane combination (warp shuffles) per statistic."""
    for name, (graph, stats) in _cuda_graphs(n, "float16").items():
        (node,) = graph.nodes
        program = auto_program(node.task, "cuda")
        assert program.kernel_names == ["kiln_row"], name
        assert program.source.count("for (int kiln_m = 16; kiln_m > 0; kiln_m >>= 1)") == stats, name


@needs_nvrtc
@pytest.mark.parametrize("dtype", ("float32", "float16", "bfloat16"))
def test_cuda_row_groups_compile_with_nvrtc(dtype):
    jobs = []
    for n in (33, 1001, 4096):
        for name, (graph, _) in _cuda_graphs(n, dtype).items():
            source = auto_program(graph.nodes[0].task, "cuda").source
            jobs += [(source, f"{name}_{n}", arch) for arch in ("sm_80", "sm_90")]
    rt.compile_many(jobs, workers=2)


def test_few_long_rows_split_their_elements_across_threads():
    """Two rows of 40000: the loop nests (a statistics buffer, then every element in parallel)
    rather than a loop over two rows; still each statistic once per row."""
    torch.manual_seed(2)
    fn = CASES["softmax_scale_mask"][0]
    x, m = torch.randn(2, 1, 1, 40000), torch.randn(1, 40000)
    (node,) = _compiled_nodes(fn, [x, m], 1e-5)
    source = auto_program(node.task, "cpu").source
    assert "for (int64_t e = 0;" not in source and source.count("malloc(") == 2
    assert len(inline_task(node.task).temporaries) == 2


@pytest.mark.parametrize("case", ["softmax_scale_mask", "hand_written_softmax"])
def test_softmax_exponentials_are_computed_once(case):
    """exp(x - max), which the sum computes for each element, is kept for the output (the
    element loop reads it back instead of calling expf again)."""
    fn, shapes, _, tol = CASES[case]
    torch.manual_seed(3)
    (node,) = _compiled_nodes(fn, _inputs(shapes(129)), tol)
    source = auto_program(node.task, "cpu").source
    statistics, element_loop = source[source.index("void kiln_kernel"):].split("for (int64_t e = 0; e < 129; ++e)")
    assert "expf(" in statistics and "expf(" not in element_loop and "kiln_kept0[e]" in element_loop


EDGE_CASES = {   # name: (kiln graph, torch reference, input, whether it is a row task)
    "bool_output": (lambda a: ops.gt(a, ops.mean(a, -1, True)), lambda a: a > a.mean(-1, keepdim=True),
                    lambda: torch.randn(9, 37), True),
    "integer_sum": (lambda a: ops.add(a, ops.sum(a, -1, True)), lambda a: a + a.sum(-1, keepdim=True),
                    lambda: torch.randint(-5, 5, (9, 37)), True),
    "float64": (lambda a: ops.sub(a, ops.mean(a, -1, True)), lambda a: a - a.mean(-1, keepdim=True),
                lambda: torch.randn(9, 300, dtype=torch.float64), True),
    "two_axis_row": (lambda a: ops.sub(a, ops.mean(a, (1, 2), True)), lambda a: a - a.mean((1, 2), keepdim=True),
                     lambda: torch.randn(4, 6, 5), True),
    "std": (lambda a: ops.div(ops.sub(a, ops.mean(a, -1, True)), ops.std(a, -1, keepdim=True)),
            lambda a: (a - a.mean(-1, keepdim=True)) / a.std(-1, keepdim=True), lambda: torch.randn(9, 37), True),
    "middle_dim": (lambda a: ops.div(a, ops.sum(a, 1, True)), lambda a: a / a.sum(1, keepdim=True),
                   lambda: torch.randn(4, 6, 5), False),
}


@pytest.mark.parametrize("case", list(EDGE_CASES))
def test_statistics_of_other_types_and_axes(case):
    """Row tasks with a bool output, integer sums, float64, a row of two axes, a standard
    deviation; a statistic over a middle dim is no row task (a buffer, then the elements)."""
    build, reference, make, is_row = EDGE_CASES[case]
    torch.manual_seed(4)
    x = make()
    sym = kiln.symbol(list(x.shape), str(x.dtype).replace("torch.", ""))
    graph = kiln.graph.optimize(kiln.trace_from(build(sym), [sym]))
    (node,) = graph.nodes
    assert ("for (int64_t e = 0;" in auto_program(node.task, "cpu").source) == is_row
    torch.testing.assert_close(graph(x).torch(), reference(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("lead", [(1,), (1, 1), (2, 1)])
def test_leading_dims_of_one_keep_the_row_kernel(lead):
    """A batch of one (Llama at batch 1: x of [1, tokens, hidden]) reads its statistic at a
    constant 0 where the output's row is an axis of extent 1: still one row kernel."""
    x, w = kiln.symbol([*lead, 70, 96], "bfloat16", "cuda"), kiln.symbol([96], "bfloat16", "cuda")
    llama = ops.mul(ops.mul(x, ops.rsqrt(ops.add(ops.mean(ops.pow(x, 2), -1, True), 1e-6))), w)
    (node,) = kiln.graph.optimize(kiln.trace_from(llama, [x, w])).nodes
    assert auto_program(node.task, "cuda").kernel_names == ["kiln_row"]
    xc, wc = torch.randn(*lead, 70, 96), torch.randn(96)
    (got,) = _compiled_nodes(lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w,
                             [xc, wc], 1e-5)
    assert "kiln_row" in auto_program(got.task, "cuda").kernel_names
