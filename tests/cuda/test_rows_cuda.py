"""Row kernels (`kiln.schedule.cuda_rows`): softmax, log_softmax, layer_norm, rms_norm and fused
row epilogues. Without a GPU: the plans (pack width, warp or block, registers) and NVRTC
compilation for sm_80 and sm_90. With a GPU (`cuda` marker): results against PyTorch for every
row length class (1, odd, vectorized warp rows, block rows, rows too long to keep in
registers), in float32, float16 and bfloat16."""
import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.plugins.registry import registry
from kiln.runtime import cuda as rt
from kiln.schedule.choose import auto_program
from tests.support import assert_close, rand

ops = kiln.ops
needs_nvrtc = pytest.mark.skipif(not rt.nvrtc_available(), reason="cuda-bindings / nvidia-cuda-nvrtc "
                                 "not installed: pip install 'kiln-core[cuda]'")

FLOAT = (torch.float32, torch.float16, torch.bfloat16)
LENGTHS = (1, 7, 768, 1000, 1001, 4096, 5000, 40000)   # 1001: not a multiple of 8 (scalar packs)
ROWS = 70


def _row_call(op: str, x: torch.Tensor):
    """(Kiln's result, PyTorch's) of `op` over the last dimension of `x`."""
    n = x.shape[-1]
    if op in ("softmax", "log_softmax"):
        return getattr(ops, op)(x, -1), getattr(torch, op)(x, -1)
    if op == "layer_norm":
        w, b = rand((n,), x.dtype).to(x.device), rand((n,), x.dtype).to(x.device)
        return ops.layer_norm(x, (n,), w, b), F.layer_norm(x, (n,), w, b)
    return ops.rms_norm(x, (n,), eps=1e-6), F.rms_norm(x, (n,), eps=1e-6)


def _task(op: str, shape, dtype):
    x = rand(shape, dtype)
    n = shape[-1]
    args = {"softmax": ((x, -1), {}), "log_softmax": ((x, -1), {}),
            "layer_norm": ((x, (n,), rand((n,), dtype), rand((n,), dtype)), {}),
            "rms_norm": ((x, (n,)), {"eps": 1e-6})}[op]
    definition = registry().operator(op)
    return definition.task(definition.bind(*args))[0]


OPS = ("softmax", "log_softmax", "layer_norm", "rms_norm")


@pytest.mark.parametrize("n,dtype,vector,lanes", [
    (768, torch.float16, 8, 32), (768, torch.float32, 4, 32), (4096, torch.float16, 8, 256),
    (4096, torch.float32, 4, 512), (1001, torch.float16, 1, 512), (7, torch.bfloat16, 1, 32)])
def test_row_plan(n, dtype, vector, lanes):
    program = auto_program(_task("layer_norm", (ROWS, n), dtype), "cuda")
    assert program.kernel_names == ["kiln_row"]
    assert f"kiln_pack<uint16_t, {vector}>" in program.source or f"kiln_pack<float, {vector}>" in program.source
    assert program.launches[0].block[0] == (256 if lanes == 32 else lanes)
    assert program.alignment == (16 if vector > 1 else 1)
    assert ("kiln_x0[" in program.source) == (n <= 5000)     # the row stays in registers


@pytest.mark.parametrize("rows, block, grid", [(512, 64, 256), (70, 64, 35), (8192, 256, 1024), (264 * 8, 256, 264)])
def test_few_warp_rows_spread_over_every_multiprocessor(rows, block, grid):
    """A row task of few warp rows (RMSNorm over 512 tokens) takes blocks of fewer warps, two
    at least, so that the grid gives each of 132 multiprocessors two blocks where it can."""
    launch = auto_program(_task("rms_norm", (rows, 2048), torch.bfloat16), "cuda").launches[0]
    assert launch.shape_for(132) == ((grid, 1, 1), (block, 1, 1))


def _log_sum_exp(x):
    """A row statistic written once a row: log-sum-exp over the last dim, kept as a size-1 dim
    (cross-entropy's over a vocabulary)."""
    xf = ops.cast(x, torch.float32)
    high = ops.amax(xf, [1], True)
    return ops.add(ops.log(ops.sum(ops.exp(ops.sub(xf, high)), [1], True)), high)


@pytest.mark.parametrize("n, lanes", [(50257, 800), (4096, 256), (1000, 32)])
def test_long_statistics_of_one_value_a_row_take_a_block(n, lanes):
    """A row whose one output value reduces a long row (a log-sum-exp over 50257 logits) takes a
    block of threads, not a warp (as many as read its packs in two groups of the online pass);
    short ones keep a warp."""
    x = kiln.symbol((256, n), torch.bfloat16, "cuda")
    graph = kiln.graph.optimize(kiln.trace_from(_log_sum_exp(x), [x]))
    (task,) = [n.task for n in graph.nodes if not n.task.is_injective]
    program = auto_program(task, "cuda")
    assert program.kernel_names == ["kiln_row"]
    assert program.launches[0].block[0] == (256 if lanes == 32 else lanes)


@pytest.mark.cuda
@pytest.mark.parametrize("n", (1000, 4096, 50257))
@pytest.mark.parametrize("dtype", FLOAT, ids=lambda d: str(d).replace("torch.", ""))
def test_long_statistics_of_one_value_a_row_match_torch(n, dtype):
    x = rand((70, n), dtype).cuda() * 4
    got = _log_sum_exp(kiln.from_torch(x)).torch()
    assert_close(got, torch.logsumexp(x.double(), 1, keepdim=True).float(), atol=1e-4, rtol=1e-5)


def _element_wise_task(shape, dtype):
    (node,) = kiln.trace_from(ops.add(kiln.symbol(shape, dtype, "cuda"), 1.5)).nodes
    return node.task


@pytest.mark.parametrize("shape, block", [((115, 1840), 256), ((115, 190), 96), ((115, 1001), 512),
                                          ((2000, 1840), 256)])
def test_few_element_wise_rows_take_a_block_each(shape, block):
    """An element-wise task whose rows would give fewer than ELEMENTWISE_THREADS threads at a
    warp a row gives each row a block, of a thread a pack up to 1024 (ResNet's stem input at
    batch 1, 115 rows of 115 cells x 16 channels, took 10 us on 115 warps, 2 us on blocks);
    with more rows, a warp takes a row (blocks of 256 threads, 8 rows)."""
    launch = auto_program(_element_wise_task(shape, "float16"), "cuda").launches[0]
    assert launch.block[0] == block
    assert launch.per_block == (8 if shape[0] == 2000 else 1)


@needs_nvrtc
def test_element_wise_block_rows_compile_with_nvrtc():
    jobs = [(auto_program(_element_wise_task(shape, "float16"), "cuda").source, f"add_{shape[1]}", "sm_90")
            for shape in ((115, 1840), (115, 190), (115, 1001))]
    rt.compile_many(jobs, workers=2)


@pytest.mark.cuda
@pytest.mark.parametrize("shape", [(115, 1840), (115, 190), (115, 1001), (70, 333)])
def test_few_element_wise_rows_match_torch(shape):
    x = rand(shape, torch.float16).cuda()
    y = kiln.trace_from(ops.add(kiln.symbol(shape, "float16", "cuda"), 1.5)).run([x])[0].torch()
    assert_close(y, x + 1.5)


@needs_nvrtc
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", FLOAT)
def test_row_kernels_compile_with_nvrtc(op, dtype):
    jobs = []
    for n in (7, 768, 1001, 4096, 40000):
        program = auto_program(_task(op, (ROWS, n), dtype), "cuda")
        jobs += [(program.source, f"{op}_{n}", arch) for arch in ("sm_80", "sm_90")]
    rt.compile_many(jobs, workers=2)


def _fused_graph(n: int, dtype: str):
    """Three fused row groups: softmax with a prologue and a per-row scale, layer_norm with a
    residual add (a second stream read only by the output), softmax of a masked input (a bool
    stream, and loads under a condition)."""
    x, y = kiln.symbol([ROWS, n], dtype, "cuda"), kiln.symbol([ROWS, n], dtype, "cuda")
    s, w = kiln.symbol([ROWS, 1], dtype, "cuda"), kiln.symbol([n], dtype, "cuda")
    m = kiln.symbol([ROWS, n], "bool", "cuda")
    soft = ops.mul(ops.exp(ops.softmax(ops.add(x, 1.0), -1)), s)
    norm = ops.add(ops.layer_norm(x, (n,), w, w), y)
    masked = ops.softmax(ops.where(m, x, -1e4), -1)
    return kiln.trace_from([soft, norm, masked], [x, y, s, w, m])


def _fused_reference(x, y, s, w, m):
    n = x.shape[-1]
    soft = torch.exp(torch.softmax(x + 1.0, -1)) * s
    masked = torch.softmax(torch.where(m, x, torch.tensor(-1e4, dtype=x.dtype, device=x.device)), -1)
    return soft, F.layer_norm(x, (n,), w, w) + y, masked


@needs_nvrtc
def test_fused_row_epilogues_use_the_row_kernel():
    opt = kiln.graph.optimize(_fused_graph(768, "float16"))
    fused = [n for n in opt.nodes if "kiln_row" in auto_program(n.task, "cuda").source]
    assert len(fused) == 3
    rt.compile_many([(auto_program(n.task, "cuda").source, n.name, arch) for n in fused for arch in ("sm_80", "sm_90")],
                    workers=2)


@pytest.mark.cuda
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("dtype", FLOAT, ids=lambda d: str(d).replace("torch.", ""))
def test_row_ops_match_torch(op, n, dtype):
    x = rand((ROWS, n), dtype).cuda()
    actual, expected = _row_call(op, x)
    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 and op in ("layer_norm", "rms_norm") else {}
    assert_close(actual, expected, **tol)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", FLOAT, ids=lambda d: str(d).replace("torch.", ""))
def test_row_ops_on_3d_inputs_and_misaligned_views(dtype):
    x = rand((3, 40, 768), dtype).cuda()
    for op in OPS:
        actual, expected = _row_call(op, x)
        assert_close(actual, expected, atol=1e-4 if dtype == torch.float32 else None,
                     rtol=1e-4 if dtype == torch.float32 else None)
    flat = rand((ROWS * 768 + 1,), dtype).cuda()
    view = flat[1:].view(ROWS, 768)                  # 2 or 4 bytes past a 16-byte boundary
    assert view.data_ptr() % 16
    assert_close(ops.softmax(view, -1), torch.softmax(view, -1))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", FLOAT, ids=lambda d: str(d).replace("torch.", ""))
def test_layer_norm_over_two_axes(dtype):
    """The row is two axes (12, 64): its reductions unflatten the row element; still packed."""
    x, w, b = rand((ROWS, 12, 64), dtype).cuda(), rand((12, 64), dtype).cuda(), rand((12, 64), dtype).cuda()
    tol = 1e-4 if dtype == torch.float32 else None
    assert_close(ops.layer_norm(x, (12, 64), w, b), F.layer_norm(x, (12, 64), w, b), atol=tol, rtol=tol)


@pytest.mark.cuda
@pytest.mark.parametrize("n", (768, 1001, 4096))
@pytest.mark.parametrize("dtype", FLOAT, ids=lambda d: str(d).replace("torch.", ""))
def test_fused_row_epilogues_match_torch(n, dtype):
    name = str(dtype).replace("torch.", "")
    opt = kiln.graph.optimize(_fused_graph(n, name))
    inputs = [rand(s, dtype).cuda() for s in ((ROWS, n), (ROWS, n), (ROWS, 1), (n,))]
    inputs.append(rand((ROWS, n), torch.bool).cuda())
    actual = opt(*inputs)
    tol = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}[dtype]
    for a, e in zip(actual, _fused_reference(*inputs)):
        torch.testing.assert_close(a.torch(), e, atol=tol, rtol=tol)
