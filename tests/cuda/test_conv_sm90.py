"""The Hopper convolution (`conv_sm90`) on the GPU: odd shapes (stride 2, padding, dilation,
rectangular windows, 1x1 as a TMA GEMM, the padded 7x7 stem, M no multiple of the tile) at the
level-0 choice in float16 and bfloat16, every knob setting of the level-1 space, a fused
bias + ReLU + residual epilogue through a compiled graph with a non-contiguous input, and
conv_tc's fallback for channels conv_sm90 declines; against float64 F.conv2d on permuted data,
into NaN-poisoned outputs."""
import pytest
import torch

import kiln
from kiln.graph import optimize
from kiln.runtime import cuda as rt
from kiln.schedule import schedules_for
from tests.cuda.conv_support import channels_last_task as _task, reference as _reference
from tests.support import rand

pytestmark = pytest.mark.cuda

SHAPES = {
    "3x3_s2": ((2, 17, 15, 16), (24, 3, 3, 16), {"stride": 2, "padding": 1}),
    "3x3_dil2": ((1, 11, 13, 32), (40, 3, 3, 32), {"padding": 2, "dilation": 2}),
    "1x1": ((3, 10, 9, 64), (72, 1, 1, 64), {}),
    "1x1_s2": ((2, 14, 14, 64), (128, 1, 1, 64), {"stride": 2}),
    "stem_7x7": ((2, 40, 40, 8), (64, 7, 7, 8), {"stride": 2, "padding": 3}),
    "3x5_rect": ((2, 13, 11, 24), (48, 3, 5, 24), {"stride": (2, 1), "padding": (1, 2)}),
    "resnet_3x3": ((4, 28, 28, 128), (128, 3, 3, 128), {"padding": 1}),
    "resnet_1x1": ((4, 28, 28, 128), (512, 1, 1, 128), {}),
    "late_3x3_b1": ((1, 7, 7, 512), (512, 3, 3, 512), {"padding": 1}),
    "odd_m_300": ((3, 10, 10, 64), (264, 3, 3, 64), {"padding": 1}),
}
DTYPES = (torch.float16, torch.bfloat16)
SWEPT = ("3x3_s2", "1x1", "stem_7x7", "late_3x3_b1")


def _needs_sm90():
    if rt.arch_number(rt.device_info(0)["arch"]) < 90:
        pytest.skip("conv_sm90 needs sm_90")


def _tensors(name, dtype, device):
    xs, ws, kwargs = SHAPES[name]
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return rand(xs, dtype, -1, 1, generator=g).to(device), rand(ws, dtype, -1, 1, generator=g).to(device), \
        rand((ws[0],), dtype, generator=g).to(device), kwargs


def _check(out, expected):
    assert not out.isnan().any(), "some outputs were never written"
    err = ((out.double() - expected).norm() / expected.norm()).item()
    assert err < 1e-2, f"relative error {err}"
    tol = 1e-2 if out.dtype == torch.float16 else 3e-2
    torch.testing.assert_close(out.double(), expected, atol=tol * expected.abs().max().item(), rtol=tol)


def _settings():
    from kiln_ops_builtin.templates import conv_sm90
    for name in SHAPES:
        for dtype in DTYPES:
            x, w, b, kwargs = _tensors(name, dtype, "cpu")
            yield name, dtype, conv_sm90.suggest(_task((x, w, b), kwargs), 132)[0]
    for name in SWEPT:
        x, w, b, kwargs = _tensors(name, torch.float16, "cpu")
        task = _task((x, w, b), kwargs)
        for knobs in conv_sm90.TEMPLATE.space(1) + conv_sm90.suggest(task, 132)[:3]:
            yield name, torch.float16, knobs


PARAMS = list(dict.fromkeys((n, d, tuple(sorted(k.items()))) for n, d, k in _settings()))


@pytest.fixture(scope="module", autouse=True)
def _compiled_in_parallel():
    """Every program of this module built at once (NVRTC threads) into the kernel cache."""
    from kiln_ops_builtin.templates import conv_sm90
    programs = []
    for name, dtype, knobs in PARAMS:
        x, w, b, kwargs = _tensors(name, dtype, "cpu")
        programs.append(conv_sm90.render(_task((x, w, b), kwargs), **dict(knobs)))
    if torch.cuda.is_available():
        rt.compile_many([(p.source, p.kernel_names[0], "sm_90a") for p in programs])


@pytest.mark.parametrize("name,dtype,knobs", PARAMS, ids=[f"{n}-{str(d)[6:]}-{'-'.join(f'{k}{v}' for k, v in kn)}"
                                                         for n, d, kn in PARAMS])
def test_conv_sm90_matches_float64(name, dtype, knobs):
    from kiln.runtime.backend import backend_for
    from kiln_ops_builtin.templates import conv_sm90
    _needs_sm90()
    x, w, b, kwargs = _tensors(name, dtype, "cuda")
    task = _task((x, w, b), kwargs)
    assert conv_sm90.applies(task)
    runner = backend_for(kiln.device("cuda")).load(conv_sm90.render(task, **dict(knobs)), kiln.device("cuda"))
    out = torch.full(task.outputs[0].shape, float("nan"), dtype=dtype, device="cuda")
    runner([x, w, b], [out])
    torch.cuda.synchronize()
    _check(out, _reference(x, w, b, kwargs))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["3x3_s2", "1x1", "resnet_3x3"])
def test_fused_bias_relu_residual_in_a_compiled_graph(name, dtype):
    """conv + bias, + residual, ReLU: one fused node on conv_sm90; x arrives non-contiguous
    (an NCHW tensor permuted to NHWC)."""
    _needs_sm90()
    ops = kiln.ops
    x, w, b, kwargs = _tensors(name, dtype, "cuda")
    out_shape = _reference(x, w, b, kwargs).shape
    res = rand(tuple(out_shape), dtype, -1, 1).cuda()
    sx, sres = (kiln.symbol(tuple(s), str(dtype)[6:], "cuda") for s in (x.shape, out_shape))
    y = ops.relu(ops.add(ops.conv2d_channels_last(sx, kiln.from_torch(w), kiln.from_torch(b), **kwargs), sres))
    graph = optimize(kiln.trace_from(y, [sx, sres]))
    (node,) = graph.nodes
    assert schedules_for(node.task, "cuda", 90)[0].name == "conv_sm90"
    x_strided = x.permute(0, 3, 1, 2).contiguous().permute(0, 2, 3, 1)
    assert not x_strided.is_contiguous()
    (out,) = graph.run([x_strided, res])
    _check(out.torch(), torch.relu(_reference(x, w, b, kwargs) + res.double()))


@pytest.mark.parametrize("xs,ws,kwargs", [((8, 1, 1, 144), (16, 1, 1, 144), {}),
                                          ((3, 2, 2, 32), (16, 1, 1, 32), {"stride": 2}),
                                          ((2, 5, 1, 16), (24, 3, 3, 16), {"padding": 1})],
                         ids=["squeeze-excite", "1x1_s2_to_1x1", "one_column"])
def test_fused_epilogues_over_single_output_positions(xs, ws, kwargs):
    """conv + bias + SiLU where an output dim has one position (its stride read as 1)."""
    _needs_sm90()
    x, w, b = (rand(s, torch.float16, -1, 1).cuda() for s in (xs, ws, ws[:1]))
    sx = kiln.symbol(list(xs), "float16", "cuda")
    y = kiln.ops.silu(kiln.ops.conv2d_channels_last(sx, kiln.from_torch(w), kiln.from_torch(b), **kwargs))
    graph = optimize(kiln.trace_from(y, [sx]))
    (node,) = graph.nodes
    assert schedules_for(node.task, "cuda", 90)[0].name == "conv_sm90"
    (out,) = graph.run([x])
    _check(out.torch(), torch.nn.functional.silu(_reference(x, w, b, kwargs)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_conv_tc_runs_what_conv_sm90_declines(dtype):
    from kiln.runtime.backend import backend_for
    from kiln_ops_builtin.templates import conv_sm90, conv_tc
    x, w, b = rand((2, 9, 11, 6), dtype, -1, 1).cuda(), rand((10, 3, 3, 6), dtype, -1, 1).cuda(), rand((10,), dtype).cuda()
    kwargs = {"stride": 2, "padding": 1}
    task = _task((x, w, b), kwargs)
    assert not conv_sm90.applies(task) and conv_tc.applies(task)
    runner = backend_for(kiln.device("cuda")).load(conv_tc.render(task, **conv_tc.TEMPLATE.space(0)[0]), kiln.device("cuda"))
    out = torch.full(task.outputs[0].shape, float("nan"), dtype=dtype, device="cuda")
    runner([x, w, b], [out])
    torch.cuda.synchronize()
    _check(out, _reference(x, w, b, kwargs))
