"""conv1d, conv2d, conv_transpose1d and conv_transpose2d against PyTorch."""
import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.graph import OperatorError
from tests.support import assert_close, rand

# Kiln sums 16-bit products in float32 and rounds once. PyTorch's conv_transpose2d rounds its
# partial sums (GEMM columns, then col2im) to the 16-bit type, so results can differ by a few
# units in the last place of partial sums of magnitude up to ~30: that is the absolute tolerance
# (one ulp at 16..32 is 2^-6 for float16 and 2^-3 for bfloat16).
SIXTEEN_BIT_TOL = {torch.float16: (5e-2, 4e-3), torch.bfloat16: (4e-1, 1.6e-2)}


def _check(kiln_fn, torch_fn, x, w, b, **kw):
    atol, rtol = SIXTEEN_BIT_TOL.get(x.dtype, (None, None))
    assert_close(kiln_fn(x, w, b, **kw), torch_fn(x, w, b, **kw), atol=atol, rtol=rtol)


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")
@pytest.mark.parametrize("xs, ws, bias, kw", [
    ((2, 4, 7, 6), (6, 4, 3, 3), True, {}),
    ((2, 4, 7, 6), (6, 2, 3, 2), False, dict(stride=2, padding=1, groups=2)),
    ((1, 4, 8, 7), (4, 1, 3, 3), True, dict(padding="same", dilation=2, groups=4)),
    ((2, 4, 6, 6), (3, 4, 2, 4), False, dict(padding="same")),          # asymmetric 'same'
    ((4, 7, 6), (3, 4, 2, 3), True, dict(stride=(2, 1), padding=(2, 0), dilation=(1, 2))),
    ((2, 3, 6, 5), (2, 3, 3, 3), True, dict(padding="valid", stride=(1, 2))),
])
def test_conv2d(xs, ws, bias, kw):
    b = rand((ws[0],)) if bias else None
    _check(kiln.ops.conv2d, F.conv2d, rand(xs), rand(ws), b, **kw)


@pytest.mark.parametrize("xs, ws, bias, kw", [
    ((2, 4, 9), (6, 4, 3), True, {}),
    ((2, 4, 9), (6, 2, 4), False, dict(stride=2, padding=2, dilation=2, groups=2)),
    ((4, 8), (3, 4, 4), True, dict(padding="same", dilation=3)),
    ((1, 3, 7), (3, 1, 3), True, dict(padding=(1,), stride=(3,), groups=3)),
])
def test_conv1d(xs, ws, bias, kw):
    b = rand((ws[0],)) if bias else None
    _check(kiln.ops.conv1d, F.conv1d, rand(xs), rand(ws), b, **kw)


@pytest.mark.parametrize("xs, ws, bias, kw", [
    ((2, 4, 5, 4), (4, 3, 3, 3), False, {}),
    ((2, 4, 5, 4), (4, 3, 3, 3), True, dict(stride=2, padding=1, output_padding=1)),
    ((2, 4, 4, 5), (4, 3, 3, 2), True,
     dict(stride=(2, 3), padding=(1, 0), dilation=(2, 1), output_padding=(1, 2), groups=2)),
    ((4, 3, 5), (4, 2, 2, 3), True, dict(stride=3, padding=(0, 2), dilation=2, output_padding=(2, 1))),
])
def test_conv_transpose2d(xs, ws, bias, kw):
    b = rand((ws[1] * kw.get("groups", 1),)) if bias else None
    _check(kiln.ops.conv_transpose2d, F.conv_transpose2d, rand(xs), rand(ws), b, **kw)


@pytest.mark.parametrize("xs, ws, bias, kw", [
    ((2, 4, 6), (4, 3, 3), False, dict(stride=2, padding=1, output_padding=1)),
    ((4, 5), (4, 1, 2), True, dict(stride=3, dilation=2, output_padding=2, groups=2)),
])
def test_conv_transpose1d(xs, ws, bias, kw):
    b = rand((ws[1] * kw.get("groups", 1),)) if bias else None
    _check(kiln.ops.conv_transpose1d, F.conv_transpose1d, rand(xs), rand(ws), b, **kw)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
def test_conv_dtypes(dtype):
    x, b = rand((2, 4, 5, 6), dtype), rand((4,), dtype)
    _check(kiln.ops.conv2d, F.conv2d, x, rand((4, 2, 3, 3), dtype), b, padding=1, groups=2)
    _check(kiln.ops.conv1d, F.conv1d, rand((2, 4, 7), dtype), rand((4, 4, 3), dtype), b, stride=2)
    _check(kiln.ops.conv_transpose2d, F.conv_transpose2d, x, rand((4, 2, 3, 3), dtype), b,
           stride=2, groups=2)


def test_conv_non_contiguous():
    x = rand((2, 6, 5, 4)).permute(0, 3, 1, 2)          # channels-last storage
    w = rand((3, 3, 4, 6)).permute(3, 2, 0, 1)[::2]     # every other output channel
    b = rand((6,))[::2]
    _check(kiln.ops.conv2d, F.conv2d, x, w, b, padding=1)
    _check(kiln.ops.conv_transpose2d, F.conv_transpose2d, x, w.transpose(0, 1), rand((3,)), stride=2)


@pytest.mark.parametrize("call, message", [
    (lambda: kiln.ops.conv2d(rand((1, 3, 5, 5)), rand((2, 4, 3, 3))),
     r"conv2d: input has 3 channels but weight \(2, 4, 3, 3\) with groups=1 expects 4"),
    (lambda: kiln.ops.conv2d(rand((1, 4, 5, 5)), rand((3, 2, 3, 3)), groups=2),
     r"conv2d: groups=2 must divide .* output channels \(3\)"),
    (lambda: kiln.ops.conv2d(rand((1, 4, 5, 5)), rand((4, 4, 3, 3)), groups=0),
     r"conv2d: groups must be a positive int"),
    (lambda: kiln.ops.conv2d(rand((1, 4, 5, 5)), rand((4, 4, 3, 3)), stride=2, padding="same"),
     r"conv2d: padding='same' is not supported for strided"),
    (lambda: kiln.ops.conv2d(rand((1, 4, 5, 5)), rand((4, 4, 3, 3)), padding="full"),
     r"conv2d: padding must be 'same', 'valid'"),
    (lambda: kiln.ops.conv2d(rand((1, 4, 2, 2)), rand((4, 4, 3, 3))),
     r"conv2d: input of shape \(1, 4, 2, 2\) gives an empty output"),
    (lambda: kiln.ops.conv2d(rand((4, 5)), rand((4, 4, 3, 3))),
     r"conv2d: expected a 3-D \(unbatched\) or 4-D input"),
    (lambda: kiln.ops.conv2d(rand((1, 4, 5, 5)), rand((4, 4, 3))),
     r"conv2d: expected a 4-D weight"),
    (lambda: kiln.ops.conv2d(rand((1, 4, 5, 5)), rand((2, 4, 3, 3)), rand((3,))),
     r"conv2d: bias of shape \(3,\) does not match 2 output channels"),
    (lambda: kiln.ops.conv2d(rand((1, 4, 5, 5), torch.int64), rand((2, 4, 3, 3), torch.int64)),
     r"conv2d: unsupported dtype int64"),
    (lambda: kiln.ops.conv1d(rand((1, 4, 5)), rand((2, 4, 3), torch.float64)),
     r"conv1d: input, weight and bias must have one dtype"),
    (lambda: kiln.ops.conv1d(rand((1, 4, 5)), rand((2, 4, 3)), stride=(1, 1)),
     r"conv1d: 'stride' must be an int or 1 ints"),
    (lambda: kiln.ops.conv_transpose2d(rand((1, 4, 5, 5)), rand((3, 2, 3, 3))),
     r"conv_transpose2d: input has 4 channels but weight \(3, 2, 3, 3\) expects 3"),
    (lambda: kiln.ops.conv_transpose2d(rand((1, 4, 5, 5)), rand((4, 2, 3, 3)), stride=2, output_padding=2),
     r"conv_transpose2d: output_padding \(2, 2\) must be smaller than either stride"),
])
def test_bad_inputs(call, message):
    with pytest.raises(OperatorError, match=message):
        call()


def test_traced_graph():
    x = kiln.symbol((1, 3, 6, 6))
    w, b = rand((4, 3, 3, 3)), rand((4,))
    graph = kiln.trace_from(kiln.ops.max_pool2d(kiln.ops.conv2d(x, w, b, padding=1), 2))
    xt = rand((1, 3, 6, 6))
    assert_close(graph(xt), F.max_pool2d(F.conv2d(xt, w, b, padding=1), 2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("xs, ws, bias, kw", [
    ((2, 7, 6, 4), (6, 3, 3, 4), True, dict(padding=1)),
    ((1, 9, 5, 6), (4, 3, 2, 3), False, dict(stride=(2, 1), padding=(1, 0), dilation=(1, 2), groups=2)),
    ((3, 5, 5, 8), (8, 1, 1, 8), True, {}),
    ((2, 7, 9, 12), (12, 5, 5, 1), True, dict(stride=2, padding=2, groups=12)),
])
def test_conv2d_channels_last_is_conv2d_on_permuted_data(dtype, xs, ws, bias, kw):
    x, w = rand(xs, dtype=dtype), rand(ws, dtype=dtype)
    b = rand((ws[0],), dtype=dtype) if bias else None
    expected = F.conv2d(x.permute(0, 3, 1, 2), w.permute(0, 3, 1, 2), b, **kw).permute(0, 2, 3, 1)
    atol, rtol = SIXTEEN_BIT_TOL.get(dtype, (None, None))
    assert_close(kiln.ops.conv2d_channels_last(x, w, b, **kw), expected, atol=atol, rtol=rtol)


def test_conv2d_channels_last_rejects_mismatched_channels():
    with pytest.raises(OperatorError, match="conv2d_channels_last"):
        kiln.ops.conv2d_channels_last(rand((1, 5, 5, 4)), rand((2, 3, 3, 3)))


class _DepthwiseTokens(torch.nn.Module):
    """SegFormer's DWConv (tokens to an image, a depthwise convolution, back to tokens), or
    with `dims=1` a depthwise conv1d over the tokens."""

    def __init__(self, channels, dims):
        super().__init__()
        conv = torch.nn.Conv1d if dims == 1 else torch.nn.Conv2d
        self.conv, self.dims = conv(channels, channels, 3, padding=1, groups=channels), dims

    def forward(self, x, side: int):
        b, n, c = x.shape
        image = x.transpose(1, 2) if self.dims == 1 else x.transpose(1, 2).reshape(b, c, side, n // side)
        return torch.nn.functional.gelu(self.conv(image)).flatten(2).transpose(1, 2)


@pytest.mark.parametrize("dims", [1, 2])
def test_depthwise_conv_between_tokens_compiles_as_eager(dims):
    from tests.frontend.frontend_support import compile_and_compare
    model = _DepthwiseTokens(32, dims).eval()
    compile_and_compare(model, rand((2, 48, 32)), 6)
