"""Which reductions the CUDA column rule (`kiln.schedule.cuda_columns`) takes: long reductions
over leading dims whose innermost kept dim is the loads' innermost (batch-norm statistics of a
channels-last tensor, sums over a batch), in two kernels (a variance and its mean sharing the
first, `kiln.schedule.cuda_moments`). No GPU needed: the programs are
planned for CUDA symbols and compiled with NVRTC; the GPU runs them in test_ops_cuda (the
`*_over_*` cases of tests/cuda/cases.py)."""
import pytest
import torch

import kiln
from kiln.runtime import cuda as rt
from kiln.schedule.choose import check_nvrtc, choose

ops = kiln.ops
needs_nvrtc = pytest.mark.skipif(not rt.nvrtc_available(), reason="cuda-bindings / nvidia-cuda-nvrtc "
                                 "not installed: pip install 'kiln-core[cuda]'")


def _kernels(make, shape, dtype="bfloat16"):
    x = kiln.symbol(list(shape), dtype, "cuda")
    graph = kiln.graph.optimize(kiln.trace_from(make(x), [x]))
    nodes = [n for n in graph.nodes if getattr(n, "task", None) is not None]
    return [(n.task, choose(n.task, "cuda", 90)) for n in nodes]


@needs_nvrtc
@pytest.mark.parametrize("make, shape", [
    (lambda x: ops.mean(ops.cast(x, torch.float32), [0, 1, 2], True), (32, 56, 56, 256)),
    (lambda x: ops.var(x, [0, 1, 2]), (5, 31, 29, 48)),
    (lambda x: ops.sum(ops.mul(x, x), 0), (6001, 33)),
    (lambda x: ops.mean(x, [1, 2], True), (8, 56, 56, 144)),      # a squeeze-excite pool (EfficientNet)
    (lambda x: ops.mean(x, [1, 2], True), (3, 23, 29, 40)),       # 667 values each, outputs not a warp's multiple
])
def test_long_reductions_over_leading_dims_take_the_column_kernel(make, shape):
    for task, program in _kernels(make, shape):
        if not task.is_injective:
            assert any(name.endswith(("_columns", "_moments")) for name in program.kernel_names)
            check_nvrtc(task, ("sm_80", "sm_90"))


@pytest.mark.parametrize("make, shape", [
    (lambda x: ops.sum(x, [0, 2, 3]), (8, 256, 28, 28)),          # NCHW: the kept dim is not innermost
    (lambda x: ops.sum(x, 0), (100, 40)),                         # too short
    (lambda x: ops.sum(x, 0), (6000, 16)),                        # fewer kept elements than a warp's lanes
    (lambda x: ops.argmax(x, 0), (6000, 40)),
])
def test_other_reductions_keep_their_kernels(make, shape):
    for task, program in _kernels(make, shape):
        assert not any(name.endswith("_columns") for name in program.kernel_names)


@pytest.mark.cuda
@pytest.mark.parametrize("shape", [(8, 56, 56, 144), (3, 23, 29, 40)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_channels_last_pooling_means_match_torch(shape, dtype):
    from tests.support import assert_close, rand
    x = rand(shape, dtype).cuda()
    tol = 1e-5 if dtype == torch.float32 else None
    assert_close(ops.mean(x, [1, 2], True), x.mean((1, 2), keepdim=True), atol=tol, rtol=tol)
