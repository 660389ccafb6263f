"""The Hopper convolution (`conv_sm90`) without a GPU: which `conv2d_channels_last` tasks it
takes and declines (and that conv_tc takes what it declines; float32 only with `allow_tf32`),
the geometry it reads back from plain and fused tasks, its producers (gathered A, or TMA for
1x1 stride-1 convolutions; 32-element k-slices in float32), its level-0 choices, and every knob
setting of its level-2 space compiled with NVRTC for sm_90a, in float32 on TF32 too."""
import pytest
import torch

import kiln
from kiln.graph import optimize
from kiln.runtime import cuda as rt
from kiln.runtime.cuda import TensorMapArg
from kiln.schedule import schedules_for
from kiln.schedule.choose import check_nvrtc
from kiln_ops_builtin.templates import conv_sm90, conv_tc
from kiln_ops_builtin.templates.conv_nhwc import match_conv_nhwc
from tests.cuda.conv_support import random_task as _task

DEFAULT = conv_sm90.DEFAULT.as_dict()

SMS = 132
needs_nvrtc = pytest.mark.skipif(not rt.nvrtc_available(), reason="cuda-bindings / nvidia-cuda-nvrtc "
                                 "not installed: pip install 'kiln-core[cuda]'")


# (x shape, weight shape, keyword arguments): stride 2 and padding, dilation, 1x1 (a GEMM), a
# strided 1x1, the padded stem (7x7, 8 channels), an M that is no multiple of any tile
SHAPES = [((2, 17, 15, 16), (24, 3, 3, 16), {"stride": 2, "padding": 1}),
          ((1, 11, 13, 32), (40, 3, 3, 32), {"padding": 2, "dilation": 2}),
          ((3, 10, 9, 64), (72, 1, 1, 64), {}),
          ((2, 14, 14, 64), (128, 1, 1, 64), {"stride": 2}),
          ((1, 40, 40, 8), (64, 7, 7, 8), {"stride": 2, "padding": 3}),
          ((2, 13, 11, 24), (48, 3, 5, 24), {"stride": (2, 1), "padding": (1, 2)})]
IDS = ["3x3_s2", "3x3_dil2", "1x1", "1x1_s2", "stem_7x7", "3x5_rect"]


@pytest.mark.parametrize("xs,ws,kwargs", SHAPES, ids=IDS)
def test_reads_the_geometry_back(xs, ws, kwargs):
    conv = match_conv_nhwc(_task(xs, ws, **kwargs))
    pair = lambda v: v if isinstance(v, tuple) else (v, v)
    assert (conv.stride, conv.padding, conv.dilation) == (pair(kwargs.get("stride", 1)), pair(kwargs.get("padding", 0)),
                                                          pair(kwargs.get("dilation", 1)))
    assert (conv.batch, conv.height, conv.width, conv.channels) == xs
    assert (conv.out_channels, conv.kh, conv.kw) == ws[:3]
    reference = torch.nn.functional.conv2d(torch.zeros(xs).permute(0, 3, 1, 2), torch.zeros(ws).permute(0, 3, 1, 2),
                                           **kwargs)
    assert (conv.out_h, conv.out_w) == reference.shape[2:]
    assert conv_sm90.applies(_task(xs, ws, **kwargs)) and conv_sm90.applies(_task(xs, ws, torch.bfloat16, **kwargs))


def test_declines_and_conv_tc_takes_over():
    odd_channels = _task((1, 9, 9, 6), (8, 3, 3, 6), padding=1)
    grouped = _task((1, 9, 9, 16), (8, 3, 3, 8), padding=1, groups=2)
    single = _task((1, 9, 9, 16), (8, 3, 3, 16), torch.float32, padding=1)
    for task in (odd_channels, grouped, single):
        assert not conv_sm90.applies(task)
    assert conv_tc.applies(odd_channels)
    assert not conv_tc.applies(grouped)      # its factors share the output channel: the auto-scheduler's
    assert [t.name for t in schedules_for(_task((1, 9, 9, 16), (8, 3, 3, 16), padding=1), "cuda", 90)] == \
        ["conv_sm90", "conv_tc"]
    assert [t.name for t in schedules_for(odd_channels, "cuda", 80)] == ["conv_tc"]


def test_float32_only_with_allow_tf32():
    """Float32 runs on TF32 tensor cores where the task allows it, its channels a multiple of
    four (one 16-byte copy); without `allow_tf32` it is declined (computed in float32
    elsewhere)."""
    for xs, ws, kwargs in SHAPES:
        assert conv_sm90.applies(_task(xs, ws, torch.float32, allow_tf32=True, **kwargs))
        assert not conv_sm90.applies(_task(xs, ws, torch.float32, **kwargs))
    assert conv_sm90.applies(_task((1, 9, 9, 12), (8, 3, 3, 12), torch.float32, padding=1, allow_tf32=True))
    assert not conv_sm90.applies(_task((1, 9, 9, 6), (8, 3, 3, 6), torch.float32, padding=1, allow_tf32=True))
    assert not conv_sm90.applies(_task((1, 9, 9, 16), (8, 3, 3, 8), torch.float32, padding=1, groups=2,
                                       allow_tf32=True))


def _fused(prologue=False, dtype="float16", **attrs):
    ops = kiln.ops
    x = kiln.symbol((2, 9, 9, 16), dtype, "cpu")
    res = kiln.symbol((2, 5, 5, 32), dtype, "cpu")
    w = kiln.from_torch(torch.randn(32, 3, 3, 16).to(getattr(torch, dtype)))
    b = kiln.from_torch(torch.randn(32).to(getattr(torch, dtype)))
    y = ops.relu(ops.add(ops.conv2d_channels_last(ops.relu(x) if prologue else x, w, b, stride=2, padding=1,
                                                  **attrs), res))
    graph = optimize(kiln.trace_from(y, [x, res]))
    return [n.task for n in graph.nodes if n.task.name == "conv2d_channels_last"][0]


def test_fused_epilogue_keeps_the_geometry_and_a_prologue_declines():
    task = _fused()
    conv = match_conv_nhwc(task)
    assert conv.stride == (2, 2) and conv.padding == (1, 1) and conv_sm90.applies(task)
    source = conv_sm90.render(task, **conv_sm90.suggest(task, SMS)[0]).source
    assert "kiln_epilogue2" in source and "kiln::conv_sm90::Gather" in source
    prologue = _fused(prologue=True)
    if match_conv_nhwc(prologue) is not None:        # the ReLU stayed a kernel of its own
        assert prologue.inputs[0].shape == (2, 9, 9, 16)
    else:
        assert not conv_sm90.applies(prologue) and conv_tc.applies(prologue)


@pytest.mark.parametrize("xs,ws,kwargs,gemm", [((8, 1, 1, 144), (16, 1, 1, 144), {}, True),
                                               ((3, 2, 2, 32), (16, 1, 1, 32), {"stride": 2}, False),
                                               ((2, 5, 1, 16), (24, 3, 3, 16), {"padding": 1}, False)],
                         ids=["squeeze-excite", "1x1_s2_to_1x1", "one_column"])
def test_a_fused_epilogue_over_single_output_positions_keeps_the_template(xs, ws, kwargs, gemm):
    """A fused task's index drops the variable of an output dim of size 1 (a squeeze-excite
    convolution's 1 x 1 pixels), which left its stride undetermined and the convolution to
    conv_tc. Its stride is taken as 1 now; only a convolution whose input has the output's
    pixels reads x as the GEMM's A."""
    x = kiln.symbol(list(xs), "float16", "cuda")
    w, b = kiln.symbol(list(ws), "float16", "cuda"), kiln.symbol([ws[0]], "float16", "cuda")
    graph = optimize(kiln.trace_from(kiln.ops.silu(kiln.ops.conv2d_channels_last(x, w, b, **kwargs)), [x, w, b]))
    (node,) = graph.nodes
    conv = match_conv_nhwc(node.task)
    assert conv is not None and conv.is_gemm == gemm and schedules_for(node.task, "cuda", 90)[0].name == "conv_sm90"


def test_epilogue_offsets_fold_back_to_pixel_times_channels():
    """The epilogue addresses NHWC outputs and residuals as m * N + n: no 64-bit division
    unravelling m into (b, oy, ox) per stored pair (it made 1x1 convolutions epilogue-bound)."""
    hooks = match_conv_nhwc(_fused()).gemm.hooks
    epilogue = hooks[hooks.index("kiln_epilogue2"):]
    assert " / " not in epilogue and " % " not in epilogue and "(m * ((int64_t)32LL))" in epilogue


def _maps(program):
    return [a for a in program.launches[0].args if isinstance(a, TensorMapArg)]


def test_producers():
    gathered = conv_sm90.render(_task((2, 17, 15, 16), (24, 3, 3, 16), stride=2, padding=1), **DEFAULT)
    (b,) = _maps(gathered)
    assert (b.dims, b.box) == ((144, 24), (64, 256)) and "PRODUCERS = 128" in gathered.source
    assert "FULL_ARRIVALS = 129" in gathered.source
    gemm = conv_sm90.render(_task((3, 10, 9, 64), (72, 1, 1, 64)), **DEFAULT)
    a, b = _maps(gemm)
    assert (a.dims, a.strides, a.box) == ((64, 270), (1, 64), (64, 128)) and (b.dims, b.box) == ((64, 72), (64, 256))
    assert "PRODUCERS = 1," in gemm.source and "kiln::conv_sm90::Gather" not in gemm.source


def test_float32_producers_read_32_element_k_slices_on_tf32():
    """A stage's 128-byte rows hold 32 float32 elements of K: the boxes are 32 deep, a gathered
    copy carries four channels, and the product is wgmma's k8 TF32. Float32 x is gathered even
    where the convolution is a GEMM (1x1): the producer threads round it to TF32 as it lands."""
    gathered = conv_sm90.render(_task((2, 17, 15, 16), (24, 3, 3, 16), torch.float32, stride=2, padding=1,
                                      allow_tf32=True), **DEFAULT)
    (b,) = _maps(gathered)
    assert (b.dims, b.box) == ((144, 24), (32, 256)) and "EPC = 4" in gathered.source
    assert "KB = 32" in gathered.source and "k8.f32.tf32.tf32" in gathered.source
    assert "const float* x(" in gathered.source and "TF32 = 1" in gathered.source
    gemm = conv_sm90.render(_task((3, 10, 9, 64), (72, 1, 1, 64), torch.float32, allow_tf32=True), **DEFAULT)
    (b,) = _maps(gemm)
    assert (b.dims, b.box) == ((64, 72), (32, 256)) and "TF32 = 1" in gemm.source
    half = conv_sm90.render(_task((2, 17, 15, 16), (24, 3, 3, 16), stride=2, padding=1), **DEFAULT).source
    assert "EPC = 8" in half and "KB = 64" in half and "const uint16_t* x(" in half and "TF32 = 0" in half


@pytest.mark.parametrize("xs,ws,kwargs,first", [
    ((32, 56, 56, 64), (256, 1, 1, 64), {}, conv_sm90.PING_PONG_WIDE.as_dict()),
    ((32, 14, 14, 1024), (512, 1, 1, 1024), {}, conv_sm90.PING_PONG.as_dict()),
    ((32, 28, 28, 128), (128, 3, 3, 128), {"padding": 1}, dict(DEFAULT, BN=128, MI=2)),
    ((32, 56, 56, 64), (64, 3, 3, 64), {"padding": 1}, conv_sm90.TALL.as_dict()),
    ((32, 14, 14, 512), (512, 3, 3, 512), {"stride": 2, "padding": 1}, dict(DEFAULT, SPLIT=5)),
    ((1, 56, 56, 64), (64, 3, 3, 64), {"padding": 1}, dict(DEFAULT, BN=64, CW=1, STAGES=8)),
    ((1, 28, 28, 512), (128, 1, 1, 512), {}, dict(DEFAULT, BN=64, CW=1, STAGES=8)),
    ((1, 7, 7, 2048), (512, 1, 1, 2048), {}, dict(DEFAULT, BN=64, CW=1, STAGES=8, SPLIT=4)),
    ((1, 7, 7, 512), (512, 3, 3, 512), {"padding": 1}, dict(DEFAULT, BN=64, CW=1, STAGES=8, SPLIT=15))])
def test_level0_choice(xs, ws, kwargs, first):
    assert conv_sm90.suggest(_task(xs, ws, **kwargs), SMS)[0] == first


def test_space_fits():
    for level in (0, 1, 2):
        for knobs in conv_sm90.ConvKnobs.space(level):
            assert knobs.fits(conv_sm90.PRODUCER_REGS[knobs.BM // 16]), knobs
    assert conv_sm90.TEMPLATE.space(0) == [DEFAULT]
    with pytest.raises(ValueError, match="unsupported setting"):
        conv_sm90.ConvKnobs(CLUSTER=2)                # the gathering producer cannot multicast


@needs_nvrtc
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("xs,ws,kwargs", [SHAPES[0], SHAPES[2], SHAPES[4]], ids=["3x3_s2", "1x1", "stem_7x7"])
def test_every_knob_setting_compiles_for_sm90a(xs, ws, kwargs, dtype):
    tf32 = {"allow_tf32": True} if dtype == torch.float32 else {}
    task = _task(xs, ws, dtype, bias=True, **kwargs, **tf32)
    settings = []
    for knobs in conv_sm90.TEMPLATE.space(2) + conv_sm90.suggest(task, SMS)[:3]:
        if knobs not in settings:
            settings.append(knobs)
    programs = [conv_sm90.render(task, **knobs) for knobs in settings]
    rt.compile_many([(p.source, p.kernel_names[0], "sm_90a") for p in programs])


@needs_nvrtc
def test_every_candidate_compiles_for_sm80_and_sm90():
    """conv_tc's programs (sm_80) and conv_sm90's (sm_90a) for a fused convolution (and for a
    float32 one on TF32: conv_sm90's, and the auto-scheduler's on sm_80), and the
    programs of ones conv_sm90 declines (odd channels: conv_tc; grouped: the auto-scheduler)."""
    check_nvrtc(_fused(), ("sm_80", "sm_90"))
    check_nvrtc(_fused(dtype="float32", allow_tf32=True), ("sm_80", "sm_90"))
    check_nvrtc(_task((1, 9, 9, 6), (8, 3, 3, 6), padding=1), ("sm_80", "sm_90"))
    check_nvrtc(_task((1, 9, 9, 16), (8, 3, 3, 8), padding=1, groups=2), ("sm_80", "sm_90"))
