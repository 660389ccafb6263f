"""Channel gates folded into per-batch weights (`kiln_ops_builtin.passes.channel_gates`): a 1x1
convolution of squeeze-excite-gated channels-last data becomes a batched matrix product of the
ungated data with scaled weights, giving the same values; other convolutions and other gates are
left alone; the pass runs on GPU graphs only."""
import pytest
import torch

import kiln
from kiln.passes.subgraph_rewrite import RewriteSubgraphs
from kiln_ops_builtin.passes.channel_gates import FoldChannelGates, fold_channel_gate
from tests.passes.passes_support import apply, names, run_both
from tests.support import rand

ops = kiln.ops


def _gated_conv(x, gate, weight, bias=None, gate_first=False, **conv):
    gated = ops.mul(gate, x) if gate_first else ops.mul(x, gate)
    return ops.conv2d_channels_last(gated, weight, bias, **conv)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("with_bias,gate_first", [(True, False), (False, False), (True, True)],
                         ids=["x*gate+bias", "x*gate", "gate*x+bias"])     # torchvision's SE: scale * input
def test_a_gated_pointwise_convolution_becomes_a_batched_product(dtype, with_bias, gate_first):
    b, h, w, c, o = 3, 5, 7, 12, 10
    x, gate = kiln.symbol([b, h, w, c], dtype), kiln.symbol([b, 1, 1, c], dtype)
    weight = kiln.from_torch(rand((o, 1, 1, c), dtype))
    bias = kiln.from_torch(rand((o,), dtype)) if with_bias else None
    graph = kiln.trace_from([_gated_conv(x, gate, weight, bias, gate_first)], [x, gate])
    out = RewriteSubgraphs([fold_channel_gate]).transform(graph, kiln.passes.PassContext())
    assert "Conv2dChannelsLast" not in names(out) and "Matmul" in names(out)
    full = [n for n in out.nodes if n.name == "Mul" and n.outputs[0].numel() == b * h * w * c]
    assert not full, "the gated data is not written"
    xs, gs = rand((b, h, w, c), dtype), torch.rand(b, 1, 1, c).to(dtype)
    if dtype == torch.float32:
        run_both(graph, out, kiln.from_torch(xs), kiln.from_torch(gs), atol=1e-5, rtol=1e-5)
        return
    # 16-bit: rounded at other places (the scaled weights, not the gated data), so each is
    # compared with float64, the rewrite within twice the original's error
    exact = torch.einsum("bhwc,oc->bhwo", xs.double() * gs.double(), weight.torch()[:, 0, 0].double())
    exact = exact + (bias.torch().double() if with_bias else 0)
    errors = [(g.run([kiln.from_torch(xs), kiln.from_torch(gs)])[0].torch().double() - exact).abs().max()
              for g in (graph, out)]
    assert errors[1] <= 2 * errors[0] + 1e-6, errors


@pytest.mark.parametrize("make", [
    lambda x, g, w3, w1: _gated_conv(x, g, w3, padding=1),                   # a 3x3 kernel
    lambda x, g, w3, w1: _gated_conv(x, g, w1, stride=2),                    # strided
    lambda x, g, w3, w1: _gated_conv(x, x, w1),                              # a full-size product
    lambda x, g, w3, w1: ops.conv2d_channels_last(ops.add(x, g), w1),        # not a product
    lambda x, g, w3, w1: _gated_conv(x, g, kiln.from_torch(torch.randn(20, 1, 1, 8))),  # 20 filters, 36 pixels
])
def test_other_convolutions_and_gates_are_left_alone(make):
    x, g = kiln.symbol([2, 6, 6, 8]), kiln.symbol([2, 1, 1, 8])
    w3, w1 = kiln.from_torch(torch.randn(4, 3, 3, 8)), kiln.from_torch(torch.randn(4, 1, 1, 8))
    graph = kiln.trace_from([make(x, g, w3, w1)], [x, g])
    assert names(RewriteSubgraphs([fold_channel_gate]).transform(graph, kiln.passes.PassContext())) == names(graph)


def test_the_pass_leaves_cpu_graphs_alone():
    x, g = kiln.symbol([2, 6, 6, 8]), kiln.symbol([2, 1, 1, 8])
    graph = kiln.trace_from([_gated_conv(x, g, kiln.from_torch(torch.randn(4, 1, 1, 8)))], [x, g])
    assert names(apply(FoldChannelGates(), graph)) == names(graph)


@pytest.mark.cuda
@torch.no_grad()
def test_a_squeeze_excite_block_on_the_gpu_matches_eager():
    from torch import nn
    torch.manual_seed(0)
    c = 40
    block = nn.Sequential(nn.Conv2d(c, c, 3, padding=1, groups=c), nn.BatchNorm2d(c), nn.SiLU())
    squeeze = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(c, 10, 1), nn.SiLU(), nn.Conv2d(10, c, 1), nn.Sigmoid())
    project = nn.Sequential(nn.Conv2d(c, 24, 1, bias=False), nn.BatchNorm2d(24))

    class SE(nn.Module):
        def __init__(self):
            super().__init__()
            self.block, self.squeeze, self.project = block, squeeze, project

        def forward(self, x):
            y = self.block(x)
            return self.project(y * self.squeeze(y))
    model = SE().eval().cuda().half()
    x = torch.randn(3, c, 17, 19, device="cuda", dtype=torch.half)
    torch._dynamo.reset()
    got = torch.compile(model, backend="kiln")(x)
    want, exact = model(x), model.double()(x.double())
    assert (got.double() - exact).abs().max() <= 2 * (want.double() - exact).abs().max() + 1e-3


def test_the_product_keeps_the_convolutions_tf32_permission():
    x, g = kiln.symbol([2, 6, 6, 8]), kiln.symbol([2, 1, 1, 8])
    weight = kiln.from_torch(torch.randn(4, 1, 1, 8))
    for tf32 in ({"allow_tf32": True}, {}):
        graph = kiln.trace_from([ops.conv2d_channels_last(ops.mul(x, g), weight, None, **tf32)], [x, g])
        out = RewriteSubgraphs([fold_channel_gate]).transform(graph, kiln.passes.PassContext())
        (product,) = [n for n in out.nodes if n.name == "Matmul"]
        assert product.attrs.get("allow_tf32", False) == bool(tf32)
