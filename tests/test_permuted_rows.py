"""Row tasks whose output permutes the rows: layer_norm(x).transpose(0, 1) (as
nn.MultiheadAttention's seq-first layout makes of ViT's pre-norm), softmax and rms_norm under a
permute of the row axes. Each runs as one row kernel computing the statistics of the row the
output's row reads (`kiln.schedule.rows.permuted_rows`): on the CPU against PyTorch, on CUDA
compiled with NVRTC (and, with a GPU, against PyTorch). A permute that moves the row's own axis
is no row permutation, and must still give PyTorch's values."""
import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.ir.inline import inline_task
from kiln.runtime import cuda as rt
from kiln.schedule.choose import auto_program
from kiln.schedule.rows import permuted_rows, row_task
from tests.support import assert_close, rand

ops = kiln.ops
needs_nvrtc = pytest.mark.skipif(not rt.nvrtc_available(), reason="cuda-bindings / nvidia-cuda-nvrtc "
                                 "not installed: pip install 'kiln-core[cuda]'")

CASES = {
    "layer_norm_t01": ((6, 37, 96), lambda x, w: ops.transpose(ops.layer_norm(x, (96,), w, w), 0, 1),
                       lambda x, w: F.layer_norm(x, (96,), w, w).transpose(0, 1)),
    "softmax_permute": ((3, 5, 11, 72), lambda x, w: ops.permute(ops.mul(ops.softmax(x, -1), w), (2, 0, 1, 3)),
                        lambda x, w: (torch.softmax(x, -1) * w).permute(2, 0, 1, 3)),
    "rms_norm_add_t01": ((9, 70, 64), lambda x, w: ops.transpose(ops.add(ops.rms_norm(x, (64,), w, 1e-6), 1.0), 0, 1),
                         lambda x, w: (F.rms_norm(x, (64,), w, 1e-6) + 1.0).transpose(0, 1)),
}


def _graph(name, dtype, device):
    shape, build, _ = CASES[name]
    x, w = kiln.symbol(shape, dtype, device), kiln.symbol((shape[-1],), dtype, device)
    return kiln.graph.optimize(kiln.trace_from(build(x, w), [x, w]))


@pytest.mark.parametrize("name", CASES)
def test_permuted_rows_are_one_row_task_matching_torch(name):
    graph = _graph(name, "float32", "cpu")
    (node,) = graph.nodes
    lowered = inline_task(node.task)
    found = row_task(lowered)
    assert found is not None and permuted_rows(lowered, *found) is not None
    shape, _, reference = CASES[name]
    x, w = rand(shape), rand((shape[-1],))
    (out,) = graph.run([x, w])
    assert_close(out, reference(x, w), atol=1e-5, rtol=1e-5)


def test_moving_the_row_axis_is_not_a_row_permutation():
    """layer_norm(x).transpose(1, 2): the output's rows cut across the normalized rows."""
    x, w = kiln.symbol((4, 9, 24), "float32", "cpu"), kiln.symbol((24,), "float32", "cpu")
    graph = kiln.graph.optimize(kiln.trace_from(ops.transpose(ops.layer_norm(x, (24,), w, w), 1, 2), [x, w]))
    for node in graph.nodes:
        lowered = inline_task(node.task)
        found = row_task(lowered)
        assert found is None or permuted_rows(lowered, *found) is None
    tx, tw = rand((4, 9, 24)), rand((24,))
    (out,) = graph.run([tx, tw])
    assert_close(out, F.layer_norm(tx, (24,), tw, tw).transpose(1, 2), atol=1e-5, rtol=1e-5)


@needs_nvrtc
def test_permuted_rows_take_the_cuda_row_kernel():
    programs = []
    for name in CASES:
        for dtype in ("float16", "float32"):
            (node,) = _graph(name, dtype, "cuda").nodes
            programs.append(auto_program(node.task, "cuda"))
            assert programs[-1].kernel_names == ["kiln_row"], name
    rt.compile_many([(p.source, p.kernel_names[0], arch) for p in programs for arch in ("sm_80", "sm_90")], workers=2)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", (torch.float32, torch.float16, torch.bfloat16), ids=str)
@pytest.mark.parametrize("name", CASES)
def test_permuted_rows_match_torch_on_the_gpu(name, dtype):
    shape, _, reference = CASES[name]
    graph = _graph(name, str(dtype).replace("torch.", ""), "cuda")
    x, w = rand(shape, dtype).cuda(), rand((shape[-1],), dtype).cuda()
    (out,) = graph.run([x, w])
    tol = 1e-4 if dtype == torch.float32 else None
    assert_close(out, reference(x, w), atol=tol, rtol=tol)
