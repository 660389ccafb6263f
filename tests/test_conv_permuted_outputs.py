"""Convolutions whose fused epilogue permutes, slices or broadcasts the output (ConvNeXt's
depthwise conv followed by a permute to channels-last): the value of every output element, on
shapes where the channel count equals the spatial size, so that matching axes by extent would
pick the wrong ones (transformers' ConvNextV2 at hidden size 8 gave 5e-3 relative error on CUDA)."""
import pytest
import torch
from torch import nn

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
# (channels, height, width): equal extents first
SHAPES = [(8, 8, 8), (16, 4, 4), (24, 24, 24), (8, 12, 8), (6, 5, 7), (40, 32, 32)]


class DepthwiseThenPermute(nn.Module):
    def __init__(self, channels: int, tail: str):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 7, padding=3, groups=channels)
        self.tail = tail

    def forward(self, x):
        y = self.conv(x)
        if self.tail == "permute":
            return y.permute(0, 2, 3, 1) * 2.0
        if self.tail == "slice":
            return y[:, :, 1:, :-1] + 1.0
        return y.permute(0, 3, 1, 2) - 1.0     # another permutation of the same extents


def _relative_error(got, want):
    return float((got.double().cpu() - want).norm() / want.norm())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tail", ["permute", "slice", "other_permute"])
@pytest.mark.parametrize("channels,height,width", SHAPES, ids=[f"{c}x{h}x{w}" for c, h, w in SHAPES])
def test_depthwise_conv_with_a_fused_view_matches_float64(device, tail, channels, height, width):
    torch.manual_seed(channels * height + width)
    model = DepthwiseThenPermute(channels, tail).eval()
    x = torch.randn(2, channels, height, width)
    with torch.no_grad():
        want = model.double()(x.double())
        model = model.float().to(device)
        torch._dynamo.reset()
        got = torch.compile(model, backend="kiln")(x.to(device))
    assert got.shape == want.shape
    assert _relative_error(got, want) < 1e-5


@pytest.mark.parametrize("device", DEVICES)
def test_small_convnextv2_matches_float64(device):
    """The model of the report: transformers' ConvNextV2 at hidden sizes 8 to 64, its default
    initialization (GRN's weights zero, so the block is its residual path)."""
    from transformers import ConvNextV2Config, ConvNextV2Model
    torch.manual_seed(0)
    model = ConvNextV2Model(ConvNextV2Config(hidden_sizes=[8, 16, 32, 64], depths=[1, 1, 1, 1],
                                             image_size=32)).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        want = model.double()(x.double()).last_hidden_state
        model = model.float().to(device)
        torch._dynamo.reset()
        got = torch.compile(model, backend="kiln")(x.to(device)).last_hidden_state
    assert _relative_error(got, want) < 1e-5
