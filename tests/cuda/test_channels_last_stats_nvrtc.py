"""The CUDA schedules of batch-norm statistics in a channels-last ResNet-50 training step
(issue 32): reductions over N, H and W keeping C, of channels-last (NHWC) memory and of NCHW
memory. No GPU needed: the programs are planned for CUDA symbols, their grids checked against
the 132 multiprocessors of an H100/H200, and compiled with NVRTC for sm_80 and sm_90; the GPU
runs them in the `cuda` tests at the end."""
import numpy as np
import pytest
import torch

import kiln
from kiln.runtime import cuda as rt
from kiln.schedule.choose import check_nvrtc, choose
from tests.cuda.host_threads import kernel_sources, run_on_host_threads

ops = kiln.ops
SMS = 132
needs_nvrtc = pytest.mark.skipif(not rt.nvrtc_available(), reason="cuda-bindings / nvidia-cuda-nvrtc "
                                 "not installed: pip install 'kiln-core[cuda]'")
NCHW = [0, 3, 1, 2]         # permute dims taking NHWC memory to its logical NCHW view


def _programs(make, shape, dtype="bfloat16"):
    """The (task, CUDA program) of each reduction in `make(x)`, x a CUDA symbol of `shape`."""
    x = kiln.symbol(list(shape), dtype, "cuda")
    graph = kiln.graph.optimize(kiln.trace_from(make(x), [x]))
    tasks = [n.task for n in graph.nodes if getattr(n, "task", None) is not None and not n.task.is_injective]
    return [(task, choose(task, "cuda", 90)) for task in tasks]


def _program(make, shape, dtype="bfloat16"):
    """The task and CUDA program of the one reduction in `make(x)`."""
    (found,) = _programs(make, shape, dtype)
    return found


def _blocks(launch) -> int:
    return launch.grid[0] * launch.grid[1] * launch.grid[2]


def _readers(program, name="in0") -> list[str]:
    """The kernels of `program` that load from the buffer `name` (the task's first input)."""
    return [k for k, source in kernel_sources(program).items() if f"{name}[" in source]


def _bn_var(x):
    """Batch-norm statistics as AOTAutograd hands them over: the variance, keeping dims, of the
    NCHW view of channels-last data (its mean a (1, C, 1, 1) buffer the variance reads)."""
    return ops.var(ops.permute(x, NCHW), [0, 2, 3], 0, True)


@needs_nvrtc
@pytest.mark.parametrize("shape", [(32, 112, 112, 64), (32, 56, 56, 256), (5, 31, 29, 257), (3, 17, 23, 40)])
def test_variance_reads_channels_last_input_once(shape):
    task, program = _program(_bn_var, shape)
    moments = [launch for launch in program.launches if launch.kernel.endswith("_moments")]
    assert len(moments) == 1, program.kernel_names
    assert _readers(program) == [moments[0].kernel], "the mean and the variance share one pass over the input"
    assert len(program.launches) <= 4
    check_nvrtc(task, ("sm_80", "sm_90"))


@needs_nvrtc
def test_resnet_bn_statistics_fill_the_gpu():
    """The 600-us case: 401408 rows of 64 channels, split over at least 8 blocks a multiprocessor."""
    _, program = _program(_bn_var, (32, 112, 112, 64))
    (first,) = [launch for launch in program.launches if launch.kernel.endswith("_moments")]
    assert _blocks(first) >= 8 * SMS


@needs_nvrtc
@pytest.mark.parametrize("make, shape", [
    (lambda x: ops.sum(ops.permute(x, NCHW), [0, 2, 3]), (32, 56, 56, 256)),     # NHWC memory, NCHW view
    (lambda x: ops.sum(x, [0, 1, 2]), (32, 56, 56, 256)),
    (lambda x: ops.mean(ops.permute(x, NCHW), [0, 2, 3], True), (32, 112, 112, 64)),
    (lambda x: ops.sum(ops.mul(ops.permute(x, NCHW), 2.0), [0, 2, 3]), (8, 9, 9, 257)),
])
def test_channels_last_sums_are_column_reductions_filling_the_gpu(make, shape):
    task, program = _program(make, shape)
    (first,) = [launch for launch in program.launches if launch.kernel.endswith("_columns")]
    assert len(program.launches) == 2
    if shape[0] * shape[1] * shape[2] >= 100_000:
        assert _blocks(first) >= 8 * SMS
    check_nvrtc(task, ("sm_80", "sm_90"))


@needs_nvrtc
@pytest.mark.parametrize("shape", [(32, 256, 56, 56), (32, 64, 112, 112), (32, 512, 28, 28), (3, 40, 60, 70)])
def test_nchw_batch_norm_sums_split_over_the_gpu(shape):
    """Sums over N, H and W of NCHW memory (their values in runs of H * W): each channel's sum
    split into parts, at least 4 blocks a multiprocessor in all."""
    task, program = _program(lambda x: ops.sum(x, [0, 2, 3]), shape)
    first = program.launches[0]
    assert first.kernel.endswith("_split") and len(program.launches) == 2
    if shape[0] * shape[2] * shape[3] >= 25_000:
        assert _blocks(first) >= 4 * SMS
    check_nvrtc(task, ("sm_80", "sm_90"))


def test_a_spread_around_a_center_that_varies_along_the_reduction_is_no_moment():
    """sum((x - y) ** 2) over rows, y another row's values: its center is not constant along
    the reduction, so it is no variance."""
    def make(x):
        d = ops.sub(x, ops.flip(x, [0]))
        return ops.sum(ops.mul(d, d), [0, 1, 2])
    for _, program in _programs(make, (4, 30, 30, 64), "float32"):
        assert not any(name.endswith("_moments") for name in program.kernel_names)


@pytest.mark.parametrize("shape, offset", [((3, 17, 23, 40), 0.0), ((4, 31, 29, 257), 1000.0)])
def test_moments_kernel_on_cpu_threads(shape, offset, tmp_path):
    """The moments kernel's own source, built for the host (a thread per CUDA thread, a barrier
    for __syncthreads): each output's parts count every row once, and the second pass's sums
    over them (as the next kernels compute them) give the mean and variance of float64."""
    _, program = _program(_bn_var, shape, "float32")
    (launch,) = [launch for launch in program.launches if launch.kernel.endswith("_moments")]
    assert launch.args[0] == "in0" and len(launch.args) == 5
    outputs, parts = program.temporaries[-1][0]
    x = torch.randn(shape) * 2 + offset
    buffers = [x.numpy()] + [np.zeros((outputs, parts), np.float32) for _ in range(4)]
    count, total, mean, m2 = [b.astype(np.float64) for b in run_on_host_threads(program, launch, buffers, tmp_path)[1:]]
    rows = shape[0] * shape[1] * shape[2]
    assert (count.sum(1) == rows).all()
    ref = x.double().reshape(rows, shape[3]).numpy()
    center = total.sum(1) / rows
    np.testing.assert_allclose(center, ref.mean(0), rtol=1e-6, atol=1e-6)
    spread = (m2 + count * (mean - center[:, None]) ** 2).sum(1) / rows
    np.testing.assert_allclose(spread, ref.var(0), rtol=1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("shape", [(32, 56, 56, 64), (5, 31, 29, 257), (2, 8, 9, 40)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("offset", [0.0, 1000.0])
def test_channels_last_statistics_match_torch_on_the_gpu(shape, dtype, offset):
    """The moments kernel's mean and variance against float64, of data far from zero too (where
    a difference of sums of squares would lose every digit)."""
    x = (torch.randn(shape, device="cuda") + offset).to(dtype)
    s = kiln.symbol(list(shape), str(dtype).replace("torch.", ""), "cuda")
    view = ops.permute(s, NCHW)
    graph = kiln.graph.optimize(kiln.trace_from([ops.var(view, [0, 2, 3], 0, True),
                                                 ops.mean(view, [0, 2, 3], True),
                                                 ops.sum(view, [0, 2, 3])], [s]))
    var, mean, total = [t.torch().double() for t in graph.run([x])]
    ref = x.double().permute(0, 3, 1, 2)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(var, ref.var((0, 2, 3), correction=0, keepdim=True), rtol=tol, atol=tol)
    torch.testing.assert_close(mean, ref.mean((0, 2, 3), keepdim=True), rtol=tol, atol=tol)
    torch.testing.assert_close(total, ref.sum((0, 2, 3)), rtol=tol, atol=tol * shape[0] * shape[1] * shape[2])
