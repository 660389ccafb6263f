"""The channels-last depthwise and grouped convolution (`conv_depthwise_nhwc`) on the GPU: odd
spatial sizes, channels of MobileNetV3, EfficientNet and ConvNeXt and channels in packs of 4 and
of 1, strides 1 and 2, 3x3, 5x5, 7x7 and rectangular filters, dilation, no padding, 4 and 8
channels a group, at the level-0 choice in float16, bfloat16 and float32; every knob setting
of the level-1 space on three shapes and of the level-2 space on one; fused bias + activation +
residual epilogues through a compiled graph with a non-contiguous input; against float64
F.conv2d on permuted data, into NaN-poisoned outputs."""
import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.graph import optimize
from kiln.runtime import cuda as rt
from kiln.schedule import schedules_for
from tests.cuda.conv_support import channels_last_task as _task, reference as _reference
from tests.support import rand

pytestmark = pytest.mark.cuda

SHAPES = {
    "3x3_c24": ((2, 7, 9, 24), (24, 3, 3, 1), {"padding": 1, "groups": 24}),
    "3x3_s2_c24": ((2, 7, 9, 24), (24, 3, 3, 1), {"stride": 2, "padding": 1, "groups": 24}),
    "5x5_c40": ((1, 9, 7, 40), (40, 5, 5, 1), {"padding": 2, "groups": 40}),
    "5x5_s2_c120": ((2, 13, 11, 120), (120, 5, 5, 1), {"stride": 2, "padding": 2, "groups": 120}),
    "7x7_c96": ((2, 9, 7, 96), (96, 7, 7, 1), {"padding": 3, "groups": 96}),
    "3x3_c20_packs_of_4": ((1, 7, 9, 20), (20, 3, 3, 1), {"padding": 1, "groups": 20}),
    "3x3_c7_packs_of_1": ((2, 7, 9, 7), (7, 3, 3, 1), {"padding": 1, "groups": 7}),
    "grouped_4": ((2, 9, 7, 32), (32, 3, 3, 4), {"padding": 1, "groups": 8}),
    "grouped_8_s2": ((2, 9, 7, 64), (64, 3, 3, 8), {"stride": 2, "padding": 1, "groups": 8}),
    "3x3_dil2": ((1, 11, 13, 48), (48, 3, 3, 1), {"padding": 2, "dilation": 2, "groups": 48}),
    "3x5_s2x1": ((2, 9, 11, 32), (32, 3, 5, 1), {"stride": (2, 1), "padding": (1, 2), "groups": 32}),
    "unpadded": ((1, 9, 7, 24), (24, 3, 3, 1), {"groups": 24}),
    "mobilenet_112x16": ((1, 112, 112, 16), (16, 3, 3, 1), {"padding": 1, "groups": 16}),
    "convnext_56x96": ((2, 56, 56, 96), (96, 7, 7, 1), {"padding": 3, "groups": 96}),
}
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SWEPT = ("3x3_s2_c24", "7x7_c96", "grouped_4")


def _tensors(name, dtype, device, bias=True):
    xs, ws, kwargs = SHAPES[name]
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    x, w = rand(xs, dtype, -1, 1, generator=g).to(device), rand(ws, dtype, -1, 1, generator=g).to(device)
    return x, w, rand((ws[0],), dtype, generator=g).to(device) if bias else None, kwargs


def _check(out, expected):
    assert not out.isnan().any(), "some outputs were never written"
    tol = {torch.float16: 1e-2, torch.bfloat16: 3e-2, torch.float32: 1e-5}[out.dtype]
    torch.testing.assert_close(out.double(), expected, atol=tol * expected.abs().max().item(), rtol=tol)


def _settings():
    from kiln_ops_builtin.templates import conv_depthwise_nhwc as dw
    for name in SHAPES:
        for dtype in DTYPES:
            task = _task(_tensors(name, dtype, "cpu")[:3], SHAPES[name][2])
            if dtype != torch.float32 or name != "grouped_8_s2":      # 8 float32 channels a group: no 16-byte pack
                yield name, dtype, dw.suggest(task, 132)[0]
    for name in SWEPT:
        task = _task(_tensors(name, torch.float16, "cpu")[:3], SHAPES[name][2])
        for knobs in dw.TEMPLATE.space(2 if name == SWEPT[0] else 1) + dw.suggest(task, 132)[:3]:
            yield name, torch.float16, knobs


PARAMS = list(dict.fromkeys((n, d, tuple(sorted(k.items()))) for n, d, k in _settings()))


@pytest.fixture(scope="module", autouse=True)
def _compiled_in_parallel():
    """Every program of this module built at once (NVRTC threads) into the kernel cache."""
    from kiln_ops_builtin.templates import conv_depthwise_nhwc as dw
    if not torch.cuda.is_available():
        return
    arch = rt.device_info(0)["arch"]
    programs = [dw.render(_task(_tensors(n, d, "cpu")[:3], SHAPES[n][2]), **dict(k)) for n, d, k in PARAMS]
    rt.compile_many([(p.source, p.kernel_names[0], p.arch_for(arch)) for p in programs])


def _run(task, knobs, operands, dtype):
    from kiln.runtime.backend import backend_for
    from kiln_ops_builtin.templates import conv_depthwise_nhwc as dw
    assert dw.applies(task)
    runner = backend_for(kiln.device("cuda")).load(dw.render(task, **knobs), kiln.device("cuda"))
    out = torch.full(task.outputs[0].shape, float("nan"), dtype=dtype, device="cuda")
    runner(operands, [out])
    torch.cuda.synchronize()
    return out


@pytest.mark.parametrize("name,dtype,knobs", PARAMS, ids=[f"{n}-{str(d)[6:]}-{'-'.join(f'{k}{v}' for k, v in kn)}"
                                                         for n, d, kn in PARAMS])
def test_conv_depthwise_nhwc_matches_float64(name, dtype, knobs):
    x, w, b, kwargs = _tensors(name, dtype, "cuda")
    out = _run(_task((x, w, b), kwargs), dict(knobs), [x, w, b], dtype)
    _check(out, _reference(x, w, b, kwargs))


def test_without_bias():
    x, w, _, kwargs = _tensors("5x5_s2_c120", torch.float16, "cuda", bias=False)
    task = _task((x, w), kwargs)
    from kiln_ops_builtin.templates import conv_depthwise_nhwc as dw
    out = _run(task, dw.suggest(task, 132)[0], [x, w], torch.float16)
    _check(out, _reference(x, w, None, kwargs))


ACTIVATIONS = {
    "relu": (kiln.ops.relu, torch.relu),
    "relu6": (lambda t: kiln.ops.hardtanh(t, 0.0, 6.0), F.relu6),
    "hardswish": (kiln.ops.hardswish, F.hardswish),
    "silu": (kiln.ops.silu, F.silu),
    "gelu": (kiln.ops.gelu, F.gelu),
}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name,activation", [("3x3_s2_c24", "hardswish"), ("5x5_c40", "relu6"),
                                             ("7x7_c96", "gelu"), ("grouped_4", "silu"),
                                             ("3x3_c20_packs_of_4", "relu")])
def test_fused_bias_activation_residual_in_a_compiled_graph(name, activation, dtype):
    """conv + bias, activation, + residual: one fused node on conv_depthwise_nhwc; x arrives
    non-contiguous (an NCHW tensor permuted to NHWC)."""
    ops = kiln.ops
    x, w, b, kwargs = _tensors(name, dtype, "cuda")
    out_shape = _reference(x, w, b, kwargs).shape
    res = rand(tuple(out_shape), dtype, -1, 1).cuda()
    sx, sres = (kiln.symbol(tuple(s), str(dtype)[6:], "cuda") for s in (x.shape, out_shape))
    ours, theirs = ACTIVATIONS[activation]
    y = ops.add(ours(ops.conv2d_channels_last(sx, kiln.from_torch(w), kiln.from_torch(b), **kwargs)), sres)
    graph = optimize(kiln.trace_from(y, [sx, sres]))
    (node,) = graph.nodes
    assert schedules_for(node.task, "cuda", rt.arch_number(rt.device_info(0)["arch"]))[0].name == "conv_depthwise_nhwc"
    x_strided = x.permute(0, 3, 1, 2).contiguous().permute(0, 2, 3, 1)
    assert not x_strided.is_contiguous()
    (out,) = graph.run([x_strided, res])
    _check(out.torch(), theirs(_reference(x, w, b, kwargs)) + res.double())


@pytest.mark.parametrize("name", ["5x5_c40", "3x3_c20_packs_of_4"])
def test_a_float32_output_of_float16_channels(name):
    """conv + bias cast to float32: the epilogue stores each pack of 8 float16 channels as 8
    floats, 32 bytes in two 16-byte stores (it once rendered a 32-byte store NVRTC rejects)."""
    x, w, b, kwargs = _tensors(name, torch.float16, "cuda")
    sx = kiln.symbol(tuple(x.shape), "float16", "cuda")
    y = kiln.ops.cast(kiln.ops.conv2d_channels_last(sx, kiln.from_torch(w), kiln.from_torch(b), **kwargs), "float32")
    graph = optimize(kiln.trace_from(y, [sx]))
    (node,) = graph.nodes
    assert schedules_for(node.task, "cuda", rt.arch_number(rt.device_info(0)["arch"]))[0].name == "conv_depthwise_nhwc"
    (out,) = graph.run([x])
    assert out.torch().dtype == torch.float32
    _check(out.torch().half(), _reference(x, w, b, kwargs))
