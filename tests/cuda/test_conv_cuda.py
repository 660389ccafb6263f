"""Convolution templates: `conv_tc` (float16/bfloat16 implicit GEMM on tensor cores, split-K for
small GEMMs) and `conv_depthwise`.

Without a GPU: which template each convolution gets, the tile and split choices, and NVRTC
builds for sm_80 and sm_90 of the programs they render. With a GPU (`cuda`-marked): ResNet-50's
shapes at batch 1, odd sizes, every knob setting, and fused bias + ReLU (+ residual) against
PyTorch in float64.
"""
import math

import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.plugins.registry import registry
from kiln.runtime import cuda as rt
from kiln_ops_builtin.templates import conv_depthwise, conv_tc
from tests.support import assert_close, rand

ops = kiln.ops
ARCHS = ("sm_80", "sm_90")
needs_nvrtc = pytest.mark.skipif(not rt.nvrtc_available(), reason="cuda-bindings / nvidia-cuda-nvrtc "
                                 "not installed: pip install 'kiln-core[cuda]'")

# (name, op, x shape, weight shape, keyword arguments); weight of conv_transpose2d is (C_in, C_out, k, k)
GEMM_CONVS = [
    ("stem_7x7_s2", "conv2d", (1, 3, 224, 224), (64, 3, 7, 7), {"stride": 2, "padding": 3}),
    ("1x1_64_256", "conv2d", (1, 64, 56, 56), (256, 64, 1, 1), {}),
    ("3x3_64", "conv2d", (1, 64, 56, 56), (64, 64, 3, 3), {"padding": 1}),
    ("3x3_s2_128", "conv2d", (1, 128, 56, 56), (128, 128, 3, 3), {"stride": 2, "padding": 1}),
    ("downsample_1x1_s2", "conv2d", (1, 256, 56, 56), (512, 256, 1, 1), {"stride": 2}),
    ("late_3x3_512_7x7", "conv2d", (1, 512, 7, 7), (512, 512, 3, 3), {"padding": 1}),
    ("late_1x1_2048_7x7", "conv2d", (1, 2048, 7, 7), (512, 2048, 1, 1), {}),
    ("odd_channels", "conv2d", (2, 5, 17, 15), (12, 5, 3, 3), {"stride": 2, "padding": 1}),
    ("odd_5x5", "conv2d", (1, 3, 9, 11), (7, 3, 5, 5), {"padding": 2}),
    ("tiny_m", "conv2d", (1, 64, 4, 4), (96, 64, 3, 3), {"padding": 1}),
    ("batch_4", "conv2d", (4, 64, 28, 28), (128, 64, 3, 3), {"padding": 1}),
    ("conv1d", "conv1d", (2, 12, 37), (20, 12, 5), {"padding": 2}),
    ("conv_transpose2d", "conv_transpose2d", (2, 6, 7, 7), (6, 4, 3, 3), {"stride": 2}),
]

DEPTHWISE = [
    ("3x3_s1", (1, 32, 56, 56), 3, {"stride": 1, "padding": 1}),
    ("3x3_s2_odd", (2, 24, 17, 19), 3, {"stride": 2, "padding": 1}),
    ("5x5_s2", (1, 40, 28, 28), 5, {"stride": 2, "padding": 2}),
    ("7x7_s1_late", (1, 96, 7, 7), 7, {"stride": 1, "padding": 3}),
    ("7x7_same", (2, 8, 13, 10), 7, {"padding": "same"}),
    ("5x5_nopad", (1, 6, 12, 12), 5, {"stride": 1}),
]

HALF = (torch.float16, torch.bfloat16)
DW_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _conv_args(op, xs, ws, dtype, device, bias=True, scale=1.0):
    x, w = rand(xs, dtype, -scale, scale).to(device), rand(ws, dtype, -scale, scale).to(device)
    out_channels = ws[1] if op == "conv_transpose2d" else ws[0]
    b = rand((out_channels,), dtype).to(device) if bias else None
    return x, w, b


def _task(op, tensors, kwargs):
    definition = registry().operator(op)
    args = [kiln.from_torch(t) if isinstance(t, torch.Tensor) else t for t in tensors]
    return definition.task(definition.bind(args, kwargs))[0]


def _depthwise_args(xs, k, dtype, device):
    c = xs[1]
    return (rand(xs, dtype).to(device), rand((c, 1, k, k), dtype).to(device), rand((c,), dtype).to(device))


def _reference(op, x, w, b, kwargs):
    f = {"conv1d": F.conv1d, "conv2d": F.conv2d, "conv_transpose2d": F.conv_transpose2d}[op]
    bd = None if b is None else b.cpu().double()
    return f(x.cpu().double(), w.cpu().double(), bd, **kwargs)


def _tolerance(dtype, k):
    """Absolute and relative tolerance of a sum of `k` products of values in [-1, 1] (x) and
    [-3, 3]: the output's rounding (relative) and float32 accumulation (grows with sqrt(k))."""
    rel = {torch.float16: 1e-2, torch.bfloat16: 3e-2, torch.float32: 1e-4, torch.float64: 1e-9}[dtype]
    return {"atol": rel * math.sqrt(k), "rtol": rel}


def _templates(task):
    from kiln.schedule import schedules_for
    return [t.name for t in schedules_for(task, "cuda")]


# ---------------------------------------------------------------- without a GPU

@pytest.mark.parametrize("name,op,xs,ws,kw", GEMM_CONVS, ids=[c[0] for c in GEMM_CONVS])
def test_half_convs_get_conv_tc_and_float32_keeps_simt(name, op, xs, ws, kw):
    for dtype in HALF:
        assert _templates(_task(op, _conv_args(op, xs, ws, dtype, "cpu"), kw))[:2] == ["conv_tc", "matmul_simt"]
    assert _templates(_task(op, _conv_args(op, xs, ws, torch.float32, "cpu"), kw)) == ["matmul_simt"]


def test_depthwise_and_grouped_selection():
    x, w, b = _depthwise_args((1, 8, 10, 10), 3, torch.float16, "cpu")
    assert _templates(_task("conv2d", (x, w, b), {"padding": 1, "groups": 8})) == ["conv_depthwise"]
    grouped = _task("conv2d", (x, rand((8, 2, 3, 3), torch.float16), None), {"groups": 4})
    assert _templates(grouped) == []
    dilated = _task("conv2d", (x, w, None), {"groups": 8, "dilation": 2})
    assert _templates(dilated) == []


def test_tiles_and_splits_for_resnet_shapes():
    assert conv_tc.auto_tile(49, 512) == (64, 64, 32, 32) and conv_tc.auto_split(8, 144) == 16     # late 3x3: split-K
    assert conv_tc.auto_tile(12544, 64) == (64, 64, 32, 32)          # stem: no half-empty 128-column tiles
    assert conv_tc.auto_tile(16, 96) == (32, 64, 16, 32)             # M fits a 32-row tile
    assert conv_tc.auto_tile(100352, 256) == (128, 128, 64, 64)      # batch 32: big tiles
    assert conv_tc.auto_split(256, 18) == 1


@needs_nvrtc
@pytest.mark.parametrize("name,op,xs,ws,kw,dtype", [
    ("late_3x3_512_7x7", "conv2d", (1, 512, 7, 7), (512, 512, 3, 3), {"padding": 1}, torch.float16),
    ("tiny_m", "conv2d", (1, 64, 4, 4), (96, 64, 3, 3), {"padding": 1}, torch.bfloat16),
    ("stem_7x7_s2", "conv2d", (1, 3, 224, 224), (64, 3, 7, 7), {"stride": 2, "padding": 3}, torch.float16),
    ("conv_transpose2d", "conv_transpose2d", (2, 6, 7, 7), (6, 4, 3, 3), {"stride": 2}, torch.bfloat16),
], ids=lambda v: v if isinstance(v, str) else None)
def test_conv_tc_compiles_with_nvrtc(name, op, xs, ws, kw, dtype):
    _compile_all("conv_tc", _task(op, _conv_args(op, xs, ws, dtype, "cpu"), kw), level=1)


@needs_nvrtc
@pytest.mark.parametrize("dtype", DW_DTYPES, ids=str)
def test_depthwise_compiles_with_nvrtc(dtype):
    for _, xs, k, kw in DEPTHWISE[1:5]:
        task = _task("conv2d", _depthwise_args(xs, k, dtype, "cpu"), {**kw, "groups": xs[1]})
        _compile_all("conv_depthwise", task, level=1 if dtype == torch.float16 else 0)


@needs_nvrtc
def test_fused_bias_relu_residual_compiles_with_nvrtc():
    for dtype in ("float16", "float32"):
        for depthwise in (False, True):
            fused = _fused_block(dtype, depthwise).nodes[-1]
            assert fused.task.name == "conv2d"
            expected = "conv_depthwise" if depthwise else "conv_tc" if dtype == "float16" else "matmul_simt"
            assert _templates(fused.task)[0] == expected
            _compile_all(expected, fused.task, level=0)


def _compile_all(template_name, task, level):
    template = next(t for t in registry().items("schedules") if getattr(t, "name", None) == template_name)
    programs = [template.render(task, **knobs) for knobs in template.space(level)]
    rt.compile_many([(p.source, f"{task.name}_{template_name}_{k}", p.arch_for(arch))
                     for k, p in enumerate(programs) for arch in ARCHS])


def _fused_block(dtype, depthwise):
    """relu(conv2d(x, w, b) + x) on 16 channels at 14 x 14 (CUDA symbols), optimized in NCHW
    (layout planning off: the channels-last path is tests/cuda/test_conv_sm90*.py's)."""
    from kiln.passes import PassContext
    x, b = kiln.symbol([1, 16, 14, 14], dtype, "cuda"), kiln.symbol([16], dtype, "cuda")
    w = kiln.symbol([16, 1, 3, 3] if depthwise else [16, 16, 3, 3], dtype, "cuda")
    y = ops.conv2d(x, w, b, padding=1, groups=16 if depthwise else 1)
    with PassContext(config={"channels_last": "never"}):
        return kiln.graph.optimize(kiln.trace_from(ops.relu(ops.add(y, x)), [x, w, b]))


# ---------------------------------------------------------------- on a GPU

@pytest.mark.cuda
@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("name,op,xs,ws,kw", GEMM_CONVS, ids=[c[0] for c in GEMM_CONVS])
def test_conv_tc_matches_torch(name, op, xs, ws, kw, dtype):
    x, w, b = _conv_args(op, xs, ws, dtype, "cuda", scale=1.0)
    assert _templates(_task(op, (x, w, b), kw))[0] == "conv_tc"
    actual = getattr(ops, op)(x, w, b, **kw)
    k = ws[0] * ws[2] * ws[3] if op == "conv_transpose2d" else math.prod(ws[1:])
    assert_close(actual, _reference(op, x, w, b, kw).to(dtype).cuda(), **_tolerance(dtype, k))


def _knob_params():
    picks = [c for c in GEMM_CONVS if c[0] in ("late_3x3_512_7x7", "odd_channels", "tiny_m", "conv_transpose2d")]
    for name, op, xs, ws, kw in picks:
        for dtype in HALF:
            for knobs in conv_tc.TEMPLATE.space(2 if name == "odd_channels" else 1):
                yield pytest.param(op, xs, ws, kw, dtype, knobs,
                                   id=f"{name}-{str(dtype)[6:]}-{'-'.join(map(str, knobs.values()))}")


@pytest.mark.cuda
@pytest.mark.parametrize("op,xs,ws,kw,dtype,knobs", list(_knob_params()))
def test_conv_tc_every_knob_setting(op, xs, ws, kw, dtype, knobs):
    x, w, b = _conv_args(op, xs, ws, dtype, "cuda")
    _run_template(conv_tc.TEMPLATE, op, (x, w, b), kw, knobs, dtype,
                  ws[0] * ws[2] * ws[3] if op == "conv_transpose2d" else math.prod(ws[1:]))


def _run_template(template, op, tensors, kw, knobs, dtype, k):
    """`template` with `knobs` on `tensors` (NaN-filled output first) against float64 PyTorch."""
    from kiln.runtime.backend import backend_for
    task = _task(op, tensors, kw)
    runner = backend_for(kiln.device("cuda")).load(template.render(task, **knobs), kiln.device("cuda"))
    out = torch.full(task.outputs[0].shape, float("nan"), dtype=dtype, device="cuda")
    runner([t for t in tensors if t is not None], [out])
    x, w, b = tensors
    assert_close(out, _reference(op, x, w, b, kw).to(dtype).cuda(), **_tolerance(dtype, k))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DW_DTYPES, ids=str)
@pytest.mark.parametrize("name,xs,k,kw", DEPTHWISE, ids=[c[0] for c in DEPTHWISE])
def test_depthwise_matches_torch(name, xs, k, kw, dtype):
    x, w, b = _depthwise_args(xs, k, dtype, "cuda")
    kw = {**kw, "groups": xs[1]}
    assert _templates(_task("conv2d", (x, w, b), kw)) == ["conv_depthwise"]
    assert_close(ops.conv2d(x, w, b, **kw), _reference("conv2d", x, w, b, kw).to(dtype).cuda(),
                 **_tolerance(dtype, k * k))


@pytest.mark.cuda
@pytest.mark.parametrize("knobs", [pytest.param(k, id="-".join(map(str, k.values())))
                                   for k in conv_depthwise.TEMPLATE.space(2)])
def test_depthwise_every_knob_setting(knobs):
    for _, xs, k, kw in DEPTHWISE[1:4]:
        x, w, b = _depthwise_args(xs, k, torch.float32, "cuda")
        _run_template(conv_depthwise.TEMPLATE, "conv2d", (x, w, b), {**kw, "groups": xs[1]}, knobs,
                      torch.float32, k * k)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("depthwise", [False, True], ids=["dense", "depthwise"])
def test_fused_bias_relu_residual_matches_torch(dtype, depthwise):
    opt = _fused_block(dtype, depthwise)
    tdtype = getattr(torch, dtype)
    v, b = rand((1, 16, 14, 14), tdtype, -1, 1), rand((16,), tdtype)
    w = rand((16, 1, 3, 3) if depthwise else (16, 16, 3, 3), tdtype, -1, 1)
    conv = F.conv2d(v.double(), w.double(), b.double(), padding=1, groups=16 if depthwise else 1)
    expected = torch.relu(conv + v.double()).to(tdtype).cuda()
    assert_close(opt(v.cuda(), w.cuda(), b.cuda()), expected, **_tolerance(tdtype, 9 if depthwise else 144))
