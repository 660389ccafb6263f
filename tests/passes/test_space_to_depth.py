"""Strided convolutions of few channels as stride-1 convolutions of space-to-depth data
(kiln_ops_builtin.passes.space_to_depth).

The models run on the CPU in float32 through torch.compile(backend="kiln") with layout planning
forced on (config "channels_last": "always"), on odd image sizes. Each must give eager PyTorch's
results, and the optimized graph must hold the convolution the pass should make, or the one
layout planning made where the pass should leave it.
"""
import pytest
import torch
from torch import nn

from kiln.ir import SymSize
from kiln.passes import PassContext
from kiln_ops_builtin.passes.space_to_depth import _stacked_weight
from tests.passes.layout_models import randomized
from tests.passes.test_layout import compiled, members


def convolutions(graph):
    return [n for n in members(graph) if n.definition.name == "conv2d_channels_last"]


class FirstLayer(nn.Module):
    """A convolution on 3 channels, batch norm and ReLU."""

    def __init__(self, kernel, stride, padding, out=8, bias=False):
        super().__init__()
        self.conv = nn.Conv2d(3, out, kernel, stride, padding, bias=bias)
        self.bn = nn.BatchNorm2d(out)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x)))


@pytest.mark.parametrize("size", [(23, 19), (32, 32)])
def test_a_7x7_stem_at_stride_2_becomes_a_4x4_convolution_of_16_channels(size):
    torch.manual_seed(0)
    graph = compiled(randomized(FirstLayer(7, 2, 3)), torch.randn(2, 3, *size))
    (conv,) = convolutions(graph)
    assert conv.inputs[1].shape == (8, 4, 4, 16)                 # K: 49 x 8 = 392 -> 16 x 16 = 256
    assert conv.attrs["stride"] in (1, (1, 1)) and conv.attrs["padding"] in (0, (0, 0))
    assert conv.inputs[0].shape[1:3] == ((size[0] + 7) // 2, (size[1] + 7) // 2)


def test_patches_become_a_1x1_convolution():
    """ViT's patch embedding: 16 x 16 patches at stride 16, with a bias."""
    torch.manual_seed(0)
    model = nn.Conv2d(3, 12, 16, 16, bias=True).eval()
    graph = compiled(model, torch.randn(2, 3, 32, 48))
    (conv,) = convolutions(graph)
    assert conv.inputs[1].shape == (12, 1, 1, 768) and conv.inputs[0].shape == (2, 2, 3, 768)


def test_uneven_strides_and_kernels():
    torch.manual_seed(0)
    graph = compiled(FirstLayer((7, 3), (2, 1), (3, 1), bias=True).eval(), torch.randn(3, 3, 21, 17))
    (conv,) = convolutions(graph)
    assert conv.inputs[1].shape == (8, 4, 3, 8)                   # 2 x 1 cells of 3 channels: 6, padded to 8


def test_what_the_pass_leaves():
    """A 3 x 3 stem at stride 2 (K 72 -> 64 saves too little), patches whose last partial cell
    the convolution never reads (the input would have to be cut), and the pass turned off."""
    torch.manual_seed(0)
    small = compiled(randomized(FirstLayer(3, 2, 1)), torch.randn(2, 3, 17, 16))
    cut = compiled(nn.Conv2d(3, 12, 16, 16).eval(), torch.randn(1, 3, 33, 32))
    with PassContext(disabled_passes=["space_to_depth"]):
        off = compiled(randomized(FirstLayer(7, 2, 3)), torch.randn(2, 3, 23, 19))
    assert [c.inputs[1].shape for g in (small, cut, off) for c in convolutions(g)] == [
        (8, 3, 3, 8), (12, 16, 16, 8), (8, 7, 7, 8)]


def test_the_stacked_weight_is_the_kernel_read_by_cells():
    """W'[o, ky, kx, (dy, dx, c)] = W[o, s ky + dy, s kx + dx, c], zero past the kernel."""
    w = torch.randn(5, 7, 7, 3)
    stacked = _stacked_weight(w, 2, 2)
    assert stacked.shape == (5, 4, 4, 16)
    for ky, kx, dy, dx, c in [(0, 0, 0, 0, 0), (1, 2, 1, 0, 2), (3, 3, 0, 0, 1), (2, 1, 1, 1, 0)]:
        assert stacked[:, ky, kx, (dy * 2 + dx) * 3 + c].equal(w[:, 2 * ky + dy, 2 * kx + dx, c])
    assert stacked[:, 3, :, 6:12].count_nonzero() == 0 and stacked[..., 12:].count_nonzero() == 0


@pytest.mark.parametrize("xs,ws", [((2, 115, 115, 16), (64, 4, 4, 16)),      # ResNet's stem, stacked
                                   ((2, 14, 14, 768), (768, 1, 1, 768)),      # ViT-B/16's patches
                                   ((1, 56, 56, 48), (96, 1, 1, 48))],        # ConvNeXt's patchify
                         ids=["stem", "vit", "convnext"])
def test_the_hopper_convolution_takes_the_stacked_convolutions(xs, ws):
    from kiln.runtime import cuda as rt
    from kiln.schedule import schedules_for
    from kiln_ops_builtin.templates import conv_sm90
    from tests.cuda.conv_support import random_task
    task = random_task(xs, ws, bias=True)
    assert schedules_for(task, "cuda", 90)[0].name == "conv_sm90"
    if rt.nvrtc_available():
        program = conv_sm90.render(task, **conv_sm90.suggest(task, 132)[0])
        rt.compile_many([(program.source, program.kernel_names[0], "sm_90a")])


@pytest.mark.cuda
@pytest.mark.parametrize("model,size,weight", [
    (lambda: randomized(FirstLayer(7, 2, 3, out=64)), (2, 3, 57, 64), (64, 4, 4, 16)),
    (lambda: nn.Conv2d(3, 96, 16, 16).eval(), (2, 3, 64, 48), (96, 1, 1, 768))], ids=["stem", "patches"])
def test_on_cuda_by_default(model, size, weight):
    torch.manual_seed(0)
    module = model().cuda().half()
    graph = compiled(module, torch.randn(*size, device="cuda", dtype=torch.float16), mode="auto", atol=2e-2, rtol=2e-2)
    assert [c.inputs[1].shape for c in convolutions(graph)] == [weight]


def test_a_symbolic_batch():
    """With the batch marked dynamic, the stacked view keeps it symbolic: other batch sizes give
    eager's values from the same rewritten graph."""
    from tests.frontend.frontend_support import Capture
    torch.manual_seed(0)
    model = randomized(FirstLayer(7, 2, 3))
    torch._dynamo.reset()
    capture = Capture()
    compiled_model = torch.compile(model, backend=capture, dynamic=False)
    with torch.no_grad(), PassContext(config={"channels_last": "always"}):
        for batch in (2, 3, 5):
            x = torch.randn(batch, 3, 20, 18)
            torch._dynamo.mark_dynamic(x, 0)
            torch.testing.assert_close(compiled_model(x), model(x), atol=1e-4, rtol=1e-4)
    # a batch served by the plan of an earlier one (`plan_reuse`) has no graph of its own
    graphs = [entry.graph for fn in capture.compiled for entry in fn.graphs.values() if entry.graph is not None]
    assert any(isinstance(g.inputs[0].shape[0], SymSize) for g in graphs)      # one took the batch symbolic
    assert all([c.inputs[1].shape for c in convolutions(g)] == [(8, 4, 4, 16)] for g in graphs)


def test_the_stacked_convolution_keeps_the_tf32_permission():
    """A stem allowed TF32 (`allow_tf32`, on CUDA float32 graphs) stays allowed as the stride-1
    convolution the pass makes of it."""
    import kiln
    from kiln.passes.edit import rebuild
    from kiln_ops_builtin.passes.space_to_depth import stacked
    x = kiln.symbol([2, 23, 19, 3])
    w = kiln.from_torch(torch.nn.functional.pad(torch.randn(8, 7, 7, 3), (0, 5)))
    for tf32 in ({"allow_tf32": True}, {}):
        padded = kiln.ops.pad(x, [0, 5])                  # as layout planning pads 3 channels to 8
        graph = kiln.trace_from(kiln.ops.conv2d_channels_last(padded, w, None, 2, 3, **tf32), [x])
        rewritten = rebuild(graph, lambda n, inputs: stacked(n, inputs) if n.definition.name == "conv2d_channels_last"
                            else None)
        (conv,) = [n for n in rewritten.nodes if n.definition.name == "conv2d_channels_last"]
        assert conv.attrs["stride"] in (1, (1, 1)) and conv.attrs.get("allow_tf32", False) == bool(tf32)
