"""The channels-last depthwise and grouped convolution (`conv_depthwise_nhwc`) without a GPU: the
grouped geometry `match_conv_nhwc` reads back, what the template takes and declines (and which
template takes what it declines), its vector width, its level-0 choices and clamped knobs, the
vector epilogue it renders (packed loads of bias, residual and per-image scale, one 16-byte
store), and its programs compiled with NVRTC: every knob setting of the level-2 space for one
shape, the level-0 choice of every shape and dtype for sm_80 and sm_90, and every candidate
of level 1 for a fused convolution."""
import pytest
import torch

import kiln
from kiln.codegen.vector_epilogue import render_vector_epilogue
from kiln.graph import optimize, trace_from
from kiln.ir.inline import inline_task
from kiln.passes import FusedOperator
from kiln.runtime import cuda as rt
from kiln.schedule import schedules_for
from kiln.schedule.choose import check_nvrtc
from kiln_ops_builtin.templates import conv_depthwise_nhwc as dw
from kiln_ops_builtin.templates.conv_nhwc import match_conv_nhwc
from tests.cuda.conv_support import random_task

SMS = 132
ops = kiln.ops
needs_nvrtc = pytest.mark.skipif(not rt.nvrtc_available(), reason="cuda-bindings / nvidia-cuda-nvrtc "
                                 "not installed: pip install 'kiln-core[cuda]'")

# (x shape, weight shape, keyword arguments): odd spatial sizes, channels of MobileNetV3 and
# EfficientNet (24, 40, 120) and ConvNeXt (96), 20 channels (packs of 4), a grouped
# convolution of 4 channels a group, stride 2, dilation 2
SHAPES = {
    "3x3_s2_c24": ((2, 7, 9, 24), (24, 3, 3, 1), {"stride": 2, "padding": 1, "groups": 24}),
    "5x5_c40": ((1, 9, 7, 40), (40, 5, 5, 1), {"padding": 2, "groups": 40}),
    "7x7_c96": ((2, 9, 7, 96), (96, 7, 7, 1), {"padding": 3, "groups": 96}),
    "3x3_dil2_c120": ((1, 11, 13, 120), (120, 3, 3, 1), {"padding": 2, "dilation": 2, "groups": 120}),
    "5x5_s2_c20": ((1, 8, 10, 20), (20, 5, 5, 1), {"stride": 2, "padding": 2, "groups": 20}),
    "grouped_4": ((2, 9, 7, 32), (32, 3, 3, 4), {"padding": 1, "groups": 8}),
}


def _task(x_shape, w_shape, dtype=torch.float16, **kwargs):
    return random_task(x_shape, w_shape, dtype, bias=True, **kwargs)


def _pair(v):
    return v if isinstance(v, tuple) else (v, v)


@pytest.mark.parametrize("name", SHAPES)
def test_reads_the_grouped_geometry_back(name):
    xs, ws, kwargs = SHAPES[name]
    conv = match_conv_nhwc(_task(xs, ws, **kwargs))
    assert (conv.batch, conv.height, conv.width, conv.channels) == xs and conv.groups == kwargs["groups"]
    assert (conv.out_channels, conv.kh, conv.kw) == ws[:3] and conv.gemm is None and conv.channels_innermost
    assert (conv.stride, conv.padding, conv.dilation) == (_pair(kwargs.get("stride", 1)), _pair(kwargs["padding"]),
                                                          _pair(kwargs.get("dilation", 1)))
    reference = torch.nn.functional.conv2d(torch.zeros(xs).permute(0, 3, 1, 2), torch.zeros(ws).permute(0, 3, 1, 2),
                                           **kwargs)
    assert (conv.out_h, conv.out_w) == reference.shape[2:]
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        assert dw.applies(_task(xs, ws, dtype, **kwargs))


@pytest.mark.parametrize("channels,group,dtype,vector", [
    (24, 1, torch.float16, 8), (20, 1, torch.float16, 4), (6, 1, torch.bfloat16, 2), (7, 1, torch.float16, 1),
    (24, 1, torch.float32, 4), (32, 4, torch.float16, 8), (32, 8, torch.float16, 8), (32, 8, torch.float32, None),
    (24, 3, torch.float16, None)])
def test_vector_width(channels, group, dtype, vector):
    task = _task((1, 5, 5, channels), (channels, 3, 3, group), dtype, padding=1, groups=channels // group)
    assert dw.vector_width(match_conv_nhwc(task)) == vector
    assert dw.applies(task) == (vector is not None)


def test_declines_what_it_does_not_cover():
    declined = {
        "multiplier": _task((1, 9, 9, 8), (16, 3, 3, 1), padding=1, groups=8),
        "16_a_group": _task((1, 9, 9, 32), (32, 3, 3, 16), padding=1, groups=2),
        "9x9": _task((1, 12, 12, 8), (8, 9, 9, 1), padding=4, groups=8),
        "stride_3": _task((1, 12, 12, 8), (8, 3, 3, 1), stride=3, groups=8),
        "float64": _task((1, 9, 9, 8), (8, 3, 3, 1), torch.float64, padding=1, groups=8),
        "ungrouped": _task((1, 9, 9, 16), (16, 3, 3, 16), padding=1),
    }
    for name, task in declined.items():
        assert not dw.applies(task), name
    assert [t.name for t in schedules_for(declined["ungrouped"], "cuda", 90)] == ["conv_sm90", "conv_tc"]
    depthwise = _task(*SHAPES["3x3_s2_c24"][:2], **SHAPES["3x3_s2_c24"][2])
    assert [t.name for t in schedules_for(depthwise, "cuda", 80)] == ["conv_depthwise_nhwc"]


def _symbols(shapes, dtype="float16"):
    return [kiln.symbol(s, dtype, "cuda") for s in shapes]


def test_an_epilogue_that_permutes_or_a_prologue_declines():
    x, w = _symbols([(2, 7, 9, 24), (24, 3, 3, 1)])
    y = ops.permute(ops.relu(ops.conv2d_channels_last(x, w, None, padding=1, groups=24)), [0, 3, 1, 2])
    graph = trace_from(y, [x, w])
    permuted = FusedOperator(graph.nodes, [x, w], graph.outputs, 0)
    assert not match_conv_nhwc(permuted.task).channels_innermost and not dw.applies(permuted.task)
    kernels = [repr(n.fused_graph) if isinstance(n, FusedOperator) else n.name for n in optimize(graph).nodes]
    assert kernels == ["FlowGraph(Conv2dChannelsLast, Relu)", "Permute"]
    graph = trace_from(ops.conv2d_channels_last(ops.relu(x), w, None, padding=1, groups=24), [x, w])
    prologue = FusedOperator(graph.nodes, [x, w], graph.outputs, 1)
    assert match_conv_nhwc(prologue.task) is None and not dw.applies(prologue.task)


@pytest.mark.parametrize("xs,k,stride,first", [
    ((1, 112, 112, 16), 3, 1, {"CB": 16, "PX": 2, "TX": 4, "TH": 8}),       # MobileNetV3, batch 1: DEFAULT, 16 channels
    ((1, 14, 14, 672), 5, 2, {"CB": 16, "PX": 1, "TX": 4, "TH": 4}),        # a small grid: SMALL
    ((8, 112, 112, 96), 3, 2, {"CB": 96, "PX": 4, "TX": 2, "TH": 8}),       # EfficientNet-B0, batch 8: STRIDED
    ((1, 112, 112, 96), 3, 2, {"CB": 32, "PX": 2, "TX": 4, "TH": 8}),       # ... batch 1: too few warps for it
    ((8, 56, 56, 96), 7, 1, {"CB": 32, "PX": 2, "TX": 4, "TH": 8}),         # ConvNeXt-tiny, batch 8
    ((8, 7, 7, 768), 7, 1, {"CB": 32, "PX": 2, "TX": 4, "TH": 7})])         # clamped to the image's rows
def test_level0_choice(xs, k, stride, first):
    c = xs[-1]
    task = _task(xs, (c, k, k, 1), stride=stride, padding=k // 2, groups=c)
    assert dw.suggest(task, SMS)[0] == first
    fitted = dw._fit(match_conv_nhwc(task), **first)
    assert fitted["NT"] <= dw.MAX_THREADS and fitted["smem"] <= dw.SMEM_LIMIT


@pytest.mark.parametrize("xs,k,knobs,dtype,pixel", [
    # float16 packs of 8 stay 16-bit in shared memory: PIX counts halves
    ((1, 112, 112, 16), 3, {"CB": 16, "PX": 1, "TX": 8, "TH": 8}, torch.float16, 16),  # 8 lanes, 8 neighbouring units
    ((8, 56, 56, 96), 7, {"CB": 32, "PX": 4, "TX": 7, "TH": 4}, torch.float16, 40),   # pixels 64 bytes, 4 apart: padded
    ((8, 56, 56, 96), 7, {"CB": 64, "PX": 4, "TX": 4, "TH": 4}, torch.float16, 64),   # a warp reads whole bank rows
    # float32 (and 16-bit packs under 16 bytes) are stored as float32: PIX counts floats
    ((1, 56, 56, 32), 3, {"CB": 16, "PX": 2, "TX": 4, "TH": 8}, torch.float32, 24),   # pixels 16 floats apart: padded
    ((1, 56, 56, 16), 3, {"CB": 64, "PX": 4, "TX": 4, "TH": 4}, torch.float32, 20)])
def test_window_pixels_are_padded_against_bank_conflicts(xs, k, knobs, dtype, pixel):
    conv = match_conv_nhwc(_task(xs, (xs[-1], k, k, 1), dtype, padding=k // 2, groups=xs[-1]))
    assert dw.stored_bytes(conv) == (2 if dtype == torch.float16 else 4)
    assert dw._fit(conv, **knobs)["PIX"] == pixel


def test_knobs_are_fitted_to_the_convolution():
    conv = match_conv_nhwc(_task((1, 3, 5, 24), (24, 7, 7, 1), padding=3, groups=24))
    for knobs in dw.TEMPLATE.space(2):
        k = dw._fit(conv, **knobs)
        assert k["CB"] <= 24 and k["TH"] <= 3 and k["PX"] <= 5 and (k["TX"] - 1) * k["PX"] < 5, (knobs, k)
        assert k["NT"] <= dw.MAX_THREADS and k["smem"] <= dw.SMEM_LIMIT
    wide = match_conv_nhwc(_task((1, 64, 256, 64), (64, 7, 7, 1), padding=3, groups=64))
    assert dw._fit(wide, CB=64, PX=8, TX=8, TH=64)["smem"] <= dw.SMEM_LIMIT
    with pytest.raises(ValueError, match="CB=0"):
        dw._fit(conv, CB=0, PX=1, TX=1, TH=1)


def _fused(extra, dtype="float16", channels=40):
    """conv2d_channels_last (depthwise 5x5, bias) and `extra(y)`, a pair (operand or None,
    result), fused by optimize."""
    x, w, b = _symbols([(2, 9, 7, channels), (channels, 5, 5, 1), (channels,)], dtype)
    y = ops.conv2d_channels_last(x, w, b, padding=2, groups=channels)
    operand, result = extra(y)
    (node,) = optimize(trace_from(result, [x, w, b] + ([operand] if operand is not None else []))).nodes
    return node.task


def test_vector_epilogue_loads_packs_and_stores_one():
    residual = _fused(lambda y: (r := _symbols([y.shape])[0], ops.add(ops.hardswish(y), r)))
    source = dw.render(residual, **dw.DepthwiseNHWCKnobs().as_dict()).source
    start = source.index("kiln_epilogue_v(")
    epilogue = source[start:source.index("#define", start)]
    assert epilogue.count("kiln_pack<uint16_t, 8> s") == 2                  # the bias and the residual
    assert "__stwb((uint4*)&out0[" in epilogue and "in3[" not in epilogue.replace("&in3[", "")
    scale = _fused(lambda y: (s := _symbols([(2, 1, 1, 40)])[0], ops.mul(y, s)))
    epilogue = dw.render(scale, **dw.DepthwiseNHWCKnobs().as_dict()).source
    assert epilogue.count("kiln_pack<uint16_t, 8> s") == 2                  # per image and channel: a pack too
    by_pixel = _fused(lambda y: (s := _symbols([(2, 9, 7, 1)])[0], ops.mul(y, s)))
    source = dw.render(by_pixel, **dw.DepthwiseNHWCKnobs().as_dict()).source
    assert source.count("kiln_pack<uint16_t, 8> s") == 1 and "in3[" in source     # one scalar per pixel
    float32 = dw.render(_fused(lambda y: (r := _symbols([y.shape], "float32")[0], ops.add(y, r)), "float32"),
                        **dw.DepthwiseNHWCKnobs().as_dict()).source
    assert "__stwb((uint4*)&out0[" in float32 and "__float_as_uint(" in float32
    widened = dw.render(_fused(lambda y: (None, ops.cast(y, "float32"))), **dw.DepthwiseNHWCKnobs().as_dict()).source
    assert widened.count("__stwb((uint4*)&out0[") == 2 and "make_uint8" not in widened     # 8 floats: two stores
    narrow = dw.render(_fused(lambda y: (r := _symbols([y.shape])[0], ops.add(y, r)), channels=6),
                       **dw.DepthwiseNHWCKnobs().as_dict()).source
    assert "__stwb((unsigned*)&out0[" in narrow


def test_vector_epilogue_refuses_an_output_it_cannot_store_as_packs():
    x, w = _symbols([(2, 7, 9, 24), (24, 3, 3, 1)])
    graph = trace_from(ops.permute(ops.conv2d_channels_last(x, w, None, padding=1, groups=24), [0, 3, 1, 2]), [x, w])
    lowered = inline_task(FusedOperator(graph.nodes, [x, w], graph.outputs, 0).task)
    out = lowered.outputs[0]
    index = lambda b, m, n: {id(out.axes[0]): b, id(out.axes[1]): n, id(out.axes[2]): m, id(out.axes[3]): m}
    with pytest.raises(ValueError, match="one pack"):
        render_vector_epilogue(lowered, out, [], index, 8)


@needs_nvrtc
def test_every_knob_setting_of_level2_compiles():
    xs, ws, kwargs = SHAPES["3x3_s2_c24"]
    task = _task(xs, ws, **kwargs)
    programs = {p.source: p for p in (dw.render(task, **k) for k in dw.TEMPLATE.space(2) + dw.suggest(task, SMS)[:1])}
    rt.compile_many([(source, "kiln_conv_depthwise_nhwc", "sm_90") for source in programs])


@needs_nvrtc
def test_every_shape_and_dtype_compiles_for_sm80_and_sm90():
    jobs = []
    for name, (xs, ws, kwargs) in SHAPES.items():
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            if dtype != torch.float16 and name not in ("7x7_c96", "5x5_s2_c20"):
                continue
            task = _task(xs, ws, dtype, **kwargs)
            source = dw.render(task, **dw.suggest(task, SMS)[0]).source
            jobs += [(source, f"{name}_{str(dtype)[6:]}", arch) for arch in ("sm_80", "sm_90")]
    rt.compile_many(jobs)


@needs_nvrtc
def test_fused_candidates_compile():
    """Every program Kiln may build (level 1) for a fused depthwise convolution with a residual,
    and with a float32 output (16-byte packs of the float16 input, two stores per pack)."""
    check_nvrtc(_fused(lambda y: (r := _symbols([y.shape])[0], ops.add(ops.silu(y), r))), ("sm_80", "sm_90"))
    check_nvrtc(_fused(lambda y: (None, ops.cast(y, "float32"))), ("sm_80", "sm_90"))
