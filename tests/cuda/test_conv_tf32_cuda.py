"""Float32 convolutions on the GPU follow cuDNN's TF32 flag (`torch.backends.cudnn.allow_tf32`),
as eager's do: with it, torch.compile(backend="kiln") runs them channels-last on conv_sm90's TF32
tensor cores; without it, in float32 as before. Odd channels (3, 5: padded to 8), stride 2,
padding, 1x1 (a GEMM), 3x3 and 7x7 windows, batch 1 and 8, NCHW and channels-last inputs,
against float64 F.conv2d; a ResNet-18 against its float64 run; and a flip of the flag after
compiling (which dynamo does not guard) takes effect at the next call.

The error bounds: TF32 keeps 10 bits of mantissa. The tensor cores read float32 operands by
dropping the low 13 bits (toward zero), where cuDNN rounds them to nearest; Kiln rounds them to
nearest too (x as conv_sm90 gathers it, constant weights in the allow_tf32 pass), so its error
has no coherent part: before it did, each product was made smaller, by 6.5e-4 on average on
ResNet-50's shapes, and through the network's layers the output drifted by 2e-2. The bound is
4x the larger of eager's TF32 error and that of round-to-nearest TF32 operands multiplied in
float64 (where cuDNN picks a kernel of no tensor cores for a shape, eager's error is float32's);
the drift (the error's projection on the expected output, relative to it) at most 1e-4; and, to
show that TF32 was used, the error at least 20x eager's float32 error."""
import pytest
import torch
import torch.nn.functional as F

from kiln.frontend.torch.backend import KilnFunction
from kiln.runtime import cuda as rt
from tests.support import cudnn_tf32

pytestmark = pytest.mark.cuda

# name: (x shape (NCHW), weight shape, bias, conv2d's keyword arguments)
SHAPES = {
    "stem_7x7_s2_c3_b8": ((8, 3, 32, 32), (16, 3, 7, 7), True, {"stride": 2, "padding": 3}),
    "3x3_c5_b1": ((1, 5, 17, 19), (24, 5, 3, 3), False, {"padding": 1}),
    "3x3_s2_b8": ((8, 32, 16, 16), (48, 32, 3, 3), True, {"stride": 2, "padding": 1}),
    "1x1_b8": ((8, 64, 14, 14), (96, 64, 1, 1), True, {}),
    "1x1_s2_b1": ((1, 64, 15, 15), (40, 64, 1, 1), False, {"stride": 2}),
    "3x3_k1152_b1": ((1, 128, 9, 9), (256, 128, 3, 3), True, {"padding": 1}),
}
CHANNELS_LAST = ("stem_7x7_s2_c3_b8", "3x3_s2_b8", "1x1_b8")
FLOAT32 = ("3x3_c5_b1", "1x1_s2_b1", "3x3_k1152_b1")
RATIO = 4.0
DRIFT = 1e-4


@pytest.fixture(autouse=True)
def _flags():
    previous = torch.backends.cuda.matmul.allow_tf32
    torch._dynamo.reset()
    yield
    torch.backends.cuda.matmul.allow_tf32 = previous
    torch._dynamo.reset()


def _needs_sm90():
    if rt.arch_number(rt.device_info(0)["arch"]) < 90:
        pytest.skip("float32 convolutions run on TF32 through conv_sm90, which needs sm_90")


def _conv(name, channels_last=False):
    """The module (a Conv2d) and input of shape `name`, random in [-1, 1]."""
    xs, ws, bias, kwargs = SHAPES[name]
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    conv = torch.nn.Conv2d(ws[1], ws[0], ws[2:], bias=bias, **kwargs)
    with torch.no_grad():
        conv.weight.copy_(torch.rand(ws, generator=g) * 2 - 1)
        if bias:
            conv.bias.copy_(torch.rand(ws[0], generator=g) * 2 - 1)
    x = (torch.rand(xs, generator=g) * 2 - 1).cuda()
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    return conv.cuda().eval(), x


def _tf32(t: torch.Tensor) -> torch.Tensor:
    """`t` (float32) rounded to TF32 (10 mantissa bits), to nearest, ties away: as cvt.rna."""
    bits = t.float().contiguous().view(torch.int32)
    return ((bits + 0x1000) & -0x2000).view(torch.float32)


def _errors(conv, x):
    """The float64 reference and a function of an output giving its relative error to it;
    eager's float32 and TF32 errors, and that of TF32-rounded operands multiplied in float64."""
    w, b = conv.weight.detach(), None if conv.bias is None else conv.bias.detach().double()
    kwargs = {"stride": conv.stride, "padding": conv.padding}
    expected = F.conv2d(x.double(), w.double(), b, **kwargs)
    err = lambda out: ((out.double() - expected).norm() / expected.norm()).item()
    err.drift = lambda out: (((out.double() - expected) * expected).sum() / (expected * expected).sum()).item()
    with torch.no_grad():
        with cudnn_tf32(False):
            float32 = err(conv(x))
        with cudnn_tf32(True):
            eager_tf32 = err(conv(x))
    rounded = err(F.conv2d(_tf32(x).double(), _tf32(w).double(), b, **kwargs))
    return err, float32, eager_tf32, rounded


def _compiled(conv, x, **options):
    with torch.no_grad():
        return torch.compile(conv, backend="kiln", options=options or None)(x)


def _check_tf32(err, out, float32, eager_tf32, rounded):
    assert not out.isnan().any()
    e, drift = err(out), err.drift(out)
    print(f"error {e:.2e} (eager {eager_tf32:.2e}, rounded operands {rounded:.2e}), drift {drift:+.1e}")
    assert e <= RATIO * max(eager_tf32, rounded), (e, eager_tf32, rounded)
    assert abs(drift) <= DRIFT, f"the outputs drift by {drift:.1e} from float64's: TF32 operands not rounded to nearest"
    assert e >= 20 * float32, f"error {e} is float32's ({float32}): TF32 was not used"


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
@pytest.mark.parametrize("name", list(SHAPES))
def test_tf32_with_cudnns_flag(name, channels_last):
    if channels_last and name not in CHANNELS_LAST:
        pytest.skip("channels-last inputs: a few shapes")
    _needs_sm90()
    conv, x = _conv(name, channels_last)
    err, float32, eager_tf32, rounded = _errors(conv, x)
    with cudnn_tf32(True):
        _check_tf32(err, _compiled(conv, x), float32, eager_tf32, rounded)


@pytest.mark.parametrize("name", FLOAT32)
def test_float32_without_it(name):
    conv, x = _conv(name)
    err, float32, _, _ = _errors(conv, x)
    with cudnn_tf32(False):
        assert err(_compiled(conv, x)) < 2e-5, float32
    torch._dynamo.reset()
    with cudnn_tf32(True):    # the option overrides the flag
        assert err(_compiled(conv, x, allow_tf32_convolution=False)) < 2e-5


def test_a_flip_after_compiling_takes_effect_at_the_next_call():
    """Dynamo does not guard cuDNN's flag: the compiled graph reads it at each call, compiles once
    for each value it sees, and keeps both plans."""
    _needs_sm90()
    conv, x = _conv("3x3_s2_b8")
    err, float32, eager_tf32, rounded = _errors(conv, x)
    compiled = torch.compile(conv, backend="kiln")
    before = set(KilnFunction.live())      # held: no new function takes the id of one of them
    with torch.no_grad():
        with cudnn_tf32(True):
            _check_tf32(err, compiled(x), float32, eager_tf32, rounded)
        (fn,) = [f for f in KilnFunction.live() if f not in before]
        assert fn.follows == ("allow_tf32_convolution",) and len(fn.graphs) == 1
        with cudnn_tf32(False):
            assert err(compiled(x)) < 2e-5 and len(fn.graphs) == 2
        with cudnn_tf32(True):
            _check_tf32(err, compiled(x), float32, eager_tf32, rounded)
        assert len(fn.graphs) == 2


def test_a_resnet_is_as_near_float64_as_eagers_tf32():
    """ResNet-18 in float32 with cuDNN's TF32 flag (its default): Kiln's output is at most 2x
    eager's TF32 error from the float64 run. With the operands truncated, the 20 layers' drift
    put it at 25x (ResNet-50: 2.0e-2 against eager's 7.8e-4)."""
    _needs_sm90()
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).eval()
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.uniform_(-0.2, 0.2)
            m.running_var.uniform_(0.5, 1.5)
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.uniform_(-0.2, 0.2)
    model, x = model.cuda(), torch.randn(4, 3, 96, 96, device="cuda")
    with torch.no_grad():
        expected = model.double()(x.double())
        model.float()
        err = lambda out: ((out.double() - expected).norm() / expected.norm()).item()
        with cudnn_tf32(True):
            eager, kiln = err(model(x)), err(torch.compile(model, backend="kiln")(x))
    print(f"ResNet-18 TF32: Kiln {kiln:.2e}, eager {eager:.2e}")
    assert kiln <= 2 * eager, (kiln, eager)
