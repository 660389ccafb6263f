"""Which reductions the CUDA column rule (`kiln.schedule.cuda_columns`) takes: long reductions
over leading dims whose innermost kept dim is the loads' innermost (batch-norm statistics of a
channels-last tensor, sums over a batch, bias gradients), in two kernels (a variance and its
mean sharing the first, `kiln.schedule.cuda_moments`), and where its first pass reads packs.
No GPU needed: the programs are planned for CUDA symbols and compiled with NVRTC, and the first
pass of float32 data runs on host threads (`tests.cuda.host_threads`); the GPU runs them in the
`cuda` tests here and in test_ops_cuda (the `*_over_*` cases of tests/cuda/cases.py)."""
import re

import numpy as np
import pytest
import torch

import kiln
from kiln.graph import OperatorError
from kiln.ir import SymSize
from kiln.runtime import cuda as rt
from kiln.schedule.choose import check_nvrtc, choose
from tests.cuda.host_threads import kernel_sources, run_on_host_threads

ops = kiln.ops
needs_nvrtc = pytest.mark.skipif(not rt.nvrtc_available(), reason="cuda-bindings / nvidia-cuda-nvrtc "
                                 "not installed: pip install 'kiln-core[cuda]'")


SMS = 132


def _kernels(make, shape, dtype="bfloat16"):
    x = kiln.symbol(list(shape), dtype, "cuda")
    graph = kiln.graph.optimize(kiln.trace_from(make(x), [x]))
    nodes = [n for n in graph.nodes if getattr(n, "task", None) is not None]
    return [(n.task, choose(n.task, "cuda", 90)) for n in nodes]


def _reduction(make, shapes, dtype="bfloat16"):
    """The task and CUDA program of the one reduction in `make(*xs)`, xs CUDA symbols of `shapes`."""
    xs = [kiln.symbol(list(shape), dtype, "cuda") for shape in shapes]
    graph = kiln.graph.optimize(kiln.trace_from(make(*xs), xs))
    (task,) = [n.task for n in graph.nodes if getattr(n, "task", None) is not None and not n.task.is_injective]
    return task, choose(task, "cuda", 90)


def _first_pass(program) -> tuple[object, str]:
    """The launch and the source of `program`'s column kernel."""
    (launch,) = [launch for launch in program.launches if launch.kernel.endswith("_columns")]
    return launch, kernel_sources(program)[launch.kernel]


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


@needs_nvrtc
@pytest.mark.parametrize("dtype, pack", [("bfloat16", "kiln_pack<uint16_t, 8>"), ("float16", "kiln_pack<uint16_t, 8>"),
                                         ("float32", "kiln_pack<float, 4>")])
@pytest.mark.parametrize("shape", [(4096, 768), (4096, 2304), (4096, 3072)])
def test_bias_gradients_read_16_byte_packs_over_the_whole_gpu(shape, dtype, pack):
    """GPT-2's bias gradients: each lane sums 16 bytes of consecutive outputs a row, from
    16-byte aligned pointers, in a grid of a block a multiprocessor at least."""
    task, program = _reduction(lambda x: ops.sum(x, 0), [shape], dtype)
    launch, source = _first_pass(program)
    assert pack in source and program.alignment == 16
    assert launch.grid[0] * launch.grid[1] >= SMS
    check_nvrtc(task, ("sm_80", "sm_90"))


@needs_nvrtc
@pytest.mark.parametrize("make, shapes, packs", [
    (lambda x: ops.sum(ops.cast(x, torch.float32), 0), [(4096, 768)], ["kiln_pack<uint16_t, 8>"]),
    (lambda x: ops.sum(x, 0), [(4096, 100)], ["kiln_pack<uint16_t, 4>"]),      # 100 outputs: packs of 4
    (lambda x, w: ops.sum(ops.mul(x, w), 0), [(4096, 768), (768,)],            # a weight broadcast over rows
     ["kiln_pack<uint16_t, 8>"] * 2),
    (lambda x, s: ops.sum(ops.mul(x, s), 0), [(4096, 768), (4096, 1)],         # a row scale: scalar loads
     ["kiln_pack<uint16_t, 8>"]),
    (lambda x: ops.mean(x, [1, 2], True), [(8, 56, 56, 144)], ["kiln_pack<uint16_t, 8>"]),
])
def test_loads_along_the_outputs_are_packs(make, shapes, packs):
    task, program = _reduction(make, shapes)
    _, source = _first_pass(program)
    assert sorted(re.findall(r"const (kiln_pack<\w+, \d>) \w+ = \*reinterpret_cast", source)) == sorted(packs)
    check_nvrtc(task, ("sm_80", "sm_90"))


@needs_nvrtc
@pytest.mark.parametrize("make, shape", [
    (lambda x: ops.sum(x, 0), (6001, 33)),                          # an odd innermost extent
    (lambda x: ops.sum(ops.slice(x, 1, 0, 32), 0), (4096, 33)),      # rows 33 elements apart
])
def test_loads_at_offsets_that_break_the_packs_stay_scalar(make, shape):
    task, program = _reduction(make, [shape])
    _, source = _first_pass(program)
    assert "kiln_pack<" not in source and program.alignment == 1
    check_nvrtc(task, ("sm_80", "sm_90"))


def test_transposed_and_symbolic_reductions_keep_their_kernels():
    """A load that reads along the outputs a row apart (a transposed operand), and rows of a
    symbolic count, are no column reductions."""
    _, program = _reduction(lambda x, y: ops.sum(ops.add(x, ops.permute(y, [1, 0])), 0), [(600, 64), (64, 600)])
    assert not any(name.endswith("_columns") for name in program.kernel_names)
    x = kiln.symbol([SymSize.named("s0", 4096), 768], "bfloat16", "cuda")
    graph = kiln.graph.optimize(kiln.trace_from(ops.sum(x, 0), [x]))
    for node in graph.nodes:
        if getattr(node, "task", None) is not None:
            assert not any(name.endswith("_columns") for name in choose(node.task, "cuda", 90).kernel_names)


@pytest.mark.parametrize("make, shapes, reference", [
    (lambda x: ops.sum(x, 0), [(1024, 256)], lambda x: x.sum(0)),                   # packs of 4, a warp wide
    (lambda x: ops.sum(x, 0), [(600, 48)], lambda x: x.sum(0)),                     # 12 packs: 16-lane blocks
    (lambda x: ops.mean(x, [1, 2], True), [(3, 23, 29, 40)], lambda x: x.sum((1, 2))),   # outputs (3, 40)
    (lambda x: ops.sum(x, 0), [(601, 33)], lambda x: x.sum(0)),                     # scalar loads
    (lambda x, w: ops.sum(ops.mul(x, w), 0), [(700, 64), (64,)], lambda x, w: (x * w).sum(0)),
    (lambda x: ops.sum(ops.slice(x, 0, 1, 600), 0), [(600, 66)], lambda x: x[1:].sum(0)),   # packs of 2
])
def test_column_kernel_on_cpu_threads(make, shapes, reference, tmp_path):
    """The column kernel's own source over float32 data, built for the host (a thread per CUDA
    thread, a barrier for __syncthreads): its parts sum to the float64 reduction."""
    _, program = _reduction(make, shapes, "float32")
    launch, _ = _first_pass(program)
    assert launch.args[-1] == "tmp0" and len(launch.args) == len(shapes) + 1
    (partials_shape, _), = program.temporaries
    xs = [torch.randn(shape) for shape in shapes]
    buffers = [x.numpy() for x in xs] + [np.zeros(partials_shape, np.float32)]
    partials = run_on_host_threads(program, launch, buffers, tmp_path)[-1]
    expected = reference(*[x.double() for x in xs]).reshape(-1).numpy()
    np.testing.assert_allclose(partials.astype(np.float64).sum(1), expected, rtol=1e-5, atol=1e-4)


def _cuda_tolerance(dtype, expected):
    """(rtol, atol) for a result of `dtype` against float64 `expected`: the result's own
    rounding, and float32 accumulation, relative to the largest value."""
    eps = {torch.bfloat16: 8e-3, torch.float16: 1e-3, torch.float32: 2e-5}[dtype]
    return eps, eps * max(1.0, expected.abs().max().item())


@pytest.mark.cuda
@pytest.mark.parametrize("shape", [(4096, 768), (4096, 2304), (333, 100), (4096, 100), (5000, 33)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_bias_gradient_sums_match_float64(shape, dtype):
    x = torch.randn(shape, device="cuda").to(dtype)
    expected = x.double().sum(0)
    rtol, atol = _cuda_tolerance(dtype, expected)
    got = ops.sum(x, 0).torch()
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), expected, rtol=rtol, atol=atol)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_widened_sums_and_products_match_float64(dtype):
    """A 16-bit input summed in float32 (`x.float().sum(0)`), and a layer norm's weight
    gradient, sum(dy * xhat) over rows, in float32."""
    x = torch.randn(4096, 768, device="cuda").to(dtype)
    expected = x.double().sum(0)
    got = ops.sum(ops.cast(x, torch.float32), 0).torch()
    torch.testing.assert_close(got.double(), expected, rtol=2e-5, atol=2e-5 * expected.abs().max().item())
    dy, xhat = torch.randn(4096, 768, device="cuda"), torch.randn(4096, 768, device="cuda")
    expected = (dy.double() * xhat.double()).sum(0)
    got = ops.sum(ops.mul(dy, xhat), 0).torch()
    torch.testing.assert_close(got.double(), expected, rtol=2e-5, atol=2e-5 * expected.abs().max().item())


@pytest.mark.cuda
@pytest.mark.parametrize("view", ["transposed", "strided", "misaligned"])
def test_sums_of_views_match_float64(view):
    """Inputs that are not a plain contiguous allocation: a transposed view, rows of a wider
    tensor, and data 2 bytes past an allocation's 16-byte alignment."""
    if view == "transposed":
        x = torch.randn(768, 4096, device="cuda").to(torch.bfloat16).t()
    elif view == "strided":
        x = torch.randn(4096, 800, device="cuda").to(torch.bfloat16)[:, :768]
    else:
        x = torch.randn(4096 * 768 + 1, device="cuda").to(torch.bfloat16)[1:].view(4096, 768)
        assert x.data_ptr() % 16
    expected = x.double().sum(0)
    rtol, atol = _cuda_tolerance(torch.bfloat16, expected)
    torch.testing.assert_close(ops.sum(x, 0).torch().double(), expected, rtol=rtol, atol=atol)


@pytest.mark.cuda
@pytest.mark.parametrize("shape", [(8, 28, 28, 64), (4, 14, 14, 768), (3, 17, 23, 40)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_channels_last_batch_norm_mean_and_variance_match_float64(shape, dtype):
    """A channels-last batch norm's statistics through the NCHW view of NHWC memory, with the
    per-channel sum of its gradient beside them."""
    x = torch.randn(shape, device="cuda").to(dtype)
    s = kiln.symbol(list(shape), str(dtype).replace("torch.", ""), "cuda")
    view = ops.permute(s, [0, 3, 1, 2])
    graph = kiln.graph.optimize(kiln.trace_from([ops.mean(view, [0, 2, 3], True), ops.var(view, [0, 2, 3], 0, True),
                                                 ops.sum(ops.mul(view, 2.0), [0, 2, 3])], [s]))
    mean, var, total = [t.torch().double() for t in graph.run([x])]
    ref = x.double().permute(0, 3, 1, 2)
    for got, expected in ((mean, ref.mean((0, 2, 3), keepdim=True)), (var, ref.var((0, 2, 3), correction=0, keepdim=True)),
                          (total, 2 * ref.sum((0, 2, 3)))):
        rtol, atol = _cuda_tolerance(dtype, expected)
        torch.testing.assert_close(got, expected, rtol=rtol, atol=atol)


@pytest.mark.cuda
@pytest.mark.parametrize("shape", [(1, 768), (4096, 0)])
def test_single_row_and_empty_output_sums(shape):
    x = torch.randn(shape, device="cuda").to(torch.bfloat16)
    got = ops.sum(x, 0).torch()
    assert got.shape == (shape[1],)
    torch.testing.assert_close(got.double(), x.double().sum(0), rtol=8e-3, atol=8e-3)


def test_a_sum_over_no_rows_is_refused():
    """Kiln refuses empty reductions, whatever the device, saying so."""
    with pytest.raises(OperatorError, match="empty reductions are not supported"):
        ops.sum(torch.randn(0, 768).to(torch.bfloat16), 0)
