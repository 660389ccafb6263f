"""The CUDA transpose rule (`kiln.schedule.cuda_transpose`): element-wise tasks that read a
tensor across its rows (a permute moving the innermost dim, with element-wise work fused around
it) take the tiled kernel, and others keep the row and general kernels. Without a GPU: which
tasks take it, and NVRTC compilation for sm_80 and sm_90. With a GPU (`cuda` marker): values
against PyTorch for odd sizes, several ranks and dtypes, fused work, non-contiguous inputs."""
import pytest
import torch

import kiln
from kiln.runtime import cuda as rt
from kiln.schedule.choose import check_nvrtc, choose
from tests.support import assert_close, rand

ops = kiln.ops
needs_nvrtc = pytest.mark.skipif(not rt.nvrtc_available(), reason="cuda-bindings / nvidia-cuda-nvrtc "
                                 "not installed: pip install 'kiln-core[cuda]'")

CASES = [   # (shape, dims of the permute)
    ((100, 333), (1, 0)),
    ((4096, 50257 // 7), (1, 0)),               # a long odd row, as a vocabulary's gradient
    ((2, 40, 35, 64), (0, 2, 3, 1)),            # NCHW to NHWC
    ((2, 35, 64, 40), (0, 3, 1, 2)),            # NHWC to NCHW
    ((3, 33, 65), (2, 0, 1)),
    ((5, 32, 32), (0, 2, 1)),
]


def _fused(dims):
    return lambda x: ops.add(ops.mul(ops.permute(ops.cast(x, torch.float32), list(dims)), 2.0), 1.0)


def _programs(make, shape, dtype):
    x = kiln.symbol(list(shape), dtype, "cuda")
    graph = kiln.graph.optimize(kiln.trace_from(make(x), [x]))
    return [(n.task, choose(n.task, "cuda", 90)) for n in graph.nodes]


@needs_nvrtc
@pytest.mark.parametrize("shape, dims", CASES)
@pytest.mark.parametrize("fused", [False, True])
def test_permutes_moving_the_innermost_dim_take_the_tiled_kernel(shape, dims, fused):
    make = _fused(dims) if fused else (lambda x: ops.permute(x, list(dims)))
    [(task, program)] = _programs(make, shape, "bfloat16")
    assert program.kernel_names == ["kiln_transpose"]
    check_nvrtc(task, ("sm_80", "sm_90"))


@pytest.mark.parametrize("make, shape", [
    (lambda x: ops.permute(x, [1, 0, 2]), (64, 48, 40)),      # the innermost dim stays: rows
    (lambda x: ops.permute(x, [1, 0]), (100, 7)),             # too short to tile
    (lambda x: ops.sum(ops.permute(x, [1, 0]), 1), (64, 64)),  # a reduction
])
def test_other_tasks_keep_their_kernels(make, shape):
    for _, program in _programs(make, shape, "float32"):
        assert "kiln_transpose" not in program.kernel_names


@pytest.mark.cuda
@pytest.mark.parametrize("shape, dims", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_permutes_match_pytorch(shape, dims, dtype):
    x = rand(shape, dtype).cuda()
    assert torch.equal(ops.permute(kiln.from_torch(x), list(dims)).torch(), x.permute(dims))


@pytest.mark.cuda
@pytest.mark.parametrize("shape, dims", CASES[:3])
def test_fused_work_and_strided_inputs_match_pytorch(shape, dims):
    x = rand((shape[-1], *shape[:-1]), torch.bfloat16).cuda().movedim(0, -1)   # not contiguous
    f = torch.compile(lambda t: t.float().permute(dims) * 2 + 1, backend="kiln")
    assert_close(f(x), x.float().permute(dims) * 2 + 1)
