"""Layout planning (kiln.passes.layout): convolution-heavy regions run channels-last.

Models go through torch.compile(backend="kiln") on the CPU in float32 with the pass forced on
(config "channels_last": "always"; by default it only takes 16-bit convolutions on CUDA) and
must give eager PyTorch's results on fresh random inputs; the optimized graph may hold layout
conversions (permutes) at the borders of the channels-last region only.
"""
import dataclasses
import importlib

import pytest
import torch

import kiln
from kiln.graph import Layout, Traits
from kiln.ir import compute, maximum
from kiln.passes import FusedOperator, PassContext, PlanLayout
from kiln.passes.layout import conv_padding, is_elementwise, runs_channels_last
from kiln.runtime.backend import BACKENDS
from kiln.schedule import CompileSession, Template
from tests.frontend.frontend_support import Capture
from tests.passes.layout_models import (
    BasicBlock, Bottleneck, Broadcasts, Classifier, ConvNeXtStage, DenseAndInception, Pools,
    SplitsAndSoftmax, SqueezeExcite, Stem, TinyConvNeXt, TinyMobileNet, TinyResNet,
    WithIntermediate, randomized,
)
from tests.passes.passes_support import apply, const, run_both

ops = kiln.ops
PERMUTES = ("permute", "transpose")



def runs(conv, mode: str) -> bool:
    """`runs_channels_last` in a session of its own (the tests change the GPU between calls)."""
    return runs_channels_last(conv, mode, CompileSession(conv.device))

def members(graph):
    """The operators of `graph`, those fused into a FusedOperator included."""
    for node in graph.nodes:
        yield from node.fused_graph.nodes if isinstance(node, FusedOperator) else [node]


def count(graph, *names) -> int:
    return sum(n.definition.name in names for n in members(graph))


def feature_map_permutes(graph) -> int:
    """The permutes and transposes of 4-D tensors (feature maps): not those of squeeze-excite
    gates folded into per-batch weights (3-D, written transposed for the product)."""
    return sum(n.definition.name in PERMUTES and len(n.inputs[0].shape) == 4 for n in members(graph))


def compiled(model, *inputs, mode="always", atol=1e-4, rtol=1e-4):
    """The optimized FlowGraph Kiln runs for `model` under config channels_last=`mode`, after
    asserting that its results match eager PyTorch's on `inputs`."""
    torch._dynamo.reset()
    capture = Capture()
    with torch.no_grad(), PassContext(config={"channels_last": mode}):
        expected = model(*inputs)
        actual = torch.compile(model, backend=capture, fullgraph=True)(*inputs)
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)
    (compiled_fn,) = capture.compiled
    (entry,) = compiled_fn.graphs.values()
    return entry.graph


def test_splits_slices_and_softmax_along_the_channels_stay_channels_last():
    torch.manual_seed(0)
    graph = compiled(randomized(SplitsAndSoftmax()), torch.randn(2, 8, 7, 6))
    assert {n.attrs["dim"] for n in members(graph)
            if n.definition.name in ("chunk", "split", "cat", "softmax")} == {3}
    assert [n.attrs["dim"] for n in members(graph) if n.definition.name == "slice"] == [1]
    assert count(graph, *PERMUTES) == 2


def test_basic_block_runs_channels_last_with_conversions_at_its_borders():
    torch.manual_seed(0)
    graph = compiled(randomized(BasicBlock(8, 8)), torch.randn(2, 8, 9, 7))
    assert count(graph, "conv2d") == 0 and count(graph, "conv2d_channels_last") == 2
    assert count(graph, *PERMUTES) == 2                    # the input's and the output's
    first = next(n for n in members(graph) if n.definition.name == "permute")
    assert first.inputs[0] is graph.inputs[0] and first.attrs["dims"] == [0, 2, 3, 1]


def test_bottleneck_with_downsample_converts_its_input_once():
    torch.manual_seed(0)
    graph = compiled(randomized(Bottleneck(16, 8, 2)), torch.randn(2, 16, 10, 11))
    assert count(graph, "conv2d_channels_last") == 4
    assert count(graph, *PERMUTES) == 2


def test_three_channel_stem_is_padded_to_eight_channels_and_pools_channels_last():
    torch.manual_seed(0)
    with PassContext(disabled_passes=["space_to_depth"]):      # which would stack the stem's 2 x 2 cells
        graph = compiled(randomized(Stem()), torch.randn(2, 3, 23, 19))
    convs = [n for n in members(graph) if n.definition.name == "conv2d_channels_last"]
    stem = convs[0]
    assert stem.inputs[0].shape == (2, 23, 19, 8)
    weight = stem.inputs[1]
    assert not weight.is_symbolic and weight.shape == (8, 7, 7, 8)          # permuted and padded now
    assert torch.count_nonzero(weight.torch()[..., 3:]) == 0
    assert count(graph, "pad") == 1                                        # the input's channels
    assert count(graph, "max_pool2d_channels_last") == 1 and count(graph, "max_pool2d") == 0
    assert count(graph, *PERMUTES) == 2


def test_concatenations_along_channels_stay_channels_last():
    torch.manual_seed(0)
    graph = compiled(randomized(DenseAndInception()), torch.randn(2, 8, 7, 9))
    cats = [n for n in members(graph) if n.definition.name in ("cat", "concat")]
    assert len(cats) == 2 and all(n.attrs["dim"] == 3 for n in cats)
    assert count(graph, "avg_pool2d_channels_last") == 1
    assert count(graph, "batch_norm_channels_last") == 1 and count(graph, "batch_norm") == 0
    assert count(graph, *PERMUTES) == 2


def test_pooling_variants_run_channels_last():
    torch.manual_seed(0)
    graph = compiled(randomized(Pools()), torch.randn(2, 8, 17, 15))
    assert count(graph, "max_pool2d_channels_last") == 2 and count(graph, "avg_pool2d_channels_last") == 1
    assert count(graph, "adaptive_max_pool2d_channels_last") == 1
    assert count(graph, *PERMUTES) == 2                    # the input's, and the head's (N, 2, 3, C)


def test_an_output_inside_the_region_is_converted_for_the_caller_only():
    torch.manual_seed(0)
    graph = compiled(randomized(WithIntermediate()), torch.randn(1, 8, 6, 6))
    assert count(graph, "conv2d_channels_last") == 3
    assert count(graph, *PERMUTES) == 3                    # the input, and both outputs


def test_pooled_head_leaves_the_region_by_a_reshape():
    torch.manual_seed(0)
    graph = compiled(randomized(Classifier()), torch.randn(3, 8, 9, 9))
    assert count(graph, "adaptive_avg_pool2d_channels_last") == 1
    assert count(graph, *PERMUTES) == 1                    # the input's: (N, 1, 1, C) is reshaped


def test_resnet_structure_end_to_end():
    torch.manual_seed(0)
    graph = compiled(randomized(TinyResNet()), torch.randn(2, 3, 32, 32))
    assert count(graph, "conv2d") == 0 and count(graph, "conv2d_channels_last") == 13
    assert count(graph, *PERMUTES) == 1


def test_non_contiguous_input():
    torch.manual_seed(0)
    x = torch.randn(2, 8, 9, 7).to(memory_format=torch.channels_last)
    compiled(randomized(BasicBlock(8, 8)), x)
    compiled(randomized(BasicBlock(8, 8)), torch.randn(2, 7, 9, 8).transpose(1, 3))


def test_broadcast_operands_activations_and_padding_stay_channels_last():
    torch.manual_seed(0)
    graph = compiled(randomized(Broadcasts()), torch.randn(2, 8, 6, 7))
    assert count(graph, "pad") == 2
    assert count(graph, *PERMUTES) == 2


def test_means_over_the_spatial_dims_stay_channels_last():
    torch.manual_seed(0)
    graph = compiled(randomized(SqueezeExcite()), torch.randn(2, 8, 7, 5))
    assert count(graph, "conv2d_channels_last") == 3
    means = [n for n in members(graph) if n.definition.name == "mean"]
    assert sorted(n.attrs["dim"] for n in means) == [[1, 2], [1, 2]]
    # the input's; the channel max (N, 1, H, W) leaves by a reshape; a sum over H alone
    # (N, C, W) reads NCHW
    assert count(graph, *PERMUTES) == 2


def test_the_models_own_permutes_cancel_with_the_conversions():
    torch.manual_seed(0)
    graph = compiled(ConvNeXtStage().eval(), torch.randn(2, 4, 18, 14))
    assert count(graph, "conv2d_channels_last") == 2
    assert feature_map_permutes(graph) == 2                # the model's two are gone (the patchify
                                                           # convolution's space-to-depth view is 6-D)


def test_float16_conversion_runs_before_the_layout_is_planned():
    x = kiln.symbol([2, 3, 9, 9])
    h = ops.relu(ops.conv2d(x, const(8, 3, 3, 3), const(8), padding=1))
    graph = kiln.trace_from(ops.max_pool2d(ops.conv2d(h, const(8, 8, 1, 1), None), 2))
    with PassContext(config={"use_fp16": True, "channels_last": "always"}):
        opt = kiln.passes.optimize(graph)
    convs = [n for n in members(opt) if n.definition.name == "conv2d_channels_last"]
    assert len(convs) == 2 and all(n.outputs[0].dtype == kiln.dtypes.float16 for n in convs)
    assert opt.outputs[0].dtype == kiln.dtypes.float32 and count(opt, *PERMUTES) == 2
    run_both(graph, opt, torch.randn(2, 3, 9, 9), atol=2e-2, rtol=2e-2)


def test_symbolic_weights_and_same_padding():
    x, w = kiln.symbol([2, 5, 7, 6]), kiln.symbol([4, 5, 3, 3])
    y = ops.relu(ops.conv2d(x, w, const(4), padding="same"))
    graph = kiln.trace_from(ops.conv2d(y, const(6, 4, 5, 1), None, padding="same"), [x, w])
    opt = apply(PlanLayout(), graph, config={"channels_last": "always"})
    convs = [n for n in opt.nodes if n.definition.name == "conv2d_channels_last"]
    assert [n.attrs["padding"] for n in convs] == [(1, 1), (2, 0)]
    assert convs[0].inputs[1].shape == (4, 3, 3, 8)        # the weight input, permuted and padded per call
    run_both(graph, opt, torch.randn(2, 5, 7, 6), torch.randn(4, 5, 3, 3), atol=1e-4, rtol=1e-4)


def test_uneven_same_padding_keeps_the_nchw_convolution():
    x = kiln.symbol([1, 4, 6, 6])
    graph = kiln.trace_from(ops.conv2d(x, const(4, 4, 4, 4), None, padding="same"))
    assert conv_padding(graph.nodes[0]) is None
    assert apply(PlanLayout(), graph, config={"channels_last": "always"}) is graph


@kiln.operator("corner_pool", traits=Traits(layout=Layout.OWN_DEFINITION))
def corner_pool(x):
    """A plugin's operator: the larger of each 2x2 block's first and last elements."""
    n, c, h, w = x.shape
    return compute((n, c, h // 2, w // 2),
                   lambda a, b, i, j: maximum(x[a, b, 2 * i, 2 * j], x[a, b, 2 * i + 1, 2 * j + 1]))


def test_a_plugin_operator_takes_part_in_layout_planning_by_its_traits():
    """An operator declaring Layout.OWN_DEFINITION runs inside a channels-last region, as the
    built-in pooling does: no conversions around it."""
    x = kiln.symbol([2, 8, 6, 6])
    y = corner_pool(ops.relu(ops.conv2d(x, const(8, 8, 3, 3), const(8), padding=1)))
    graph = kiln.trace_from(ops.conv2d(y, const(8, 8, 1, 1), None), [x])
    opt = apply(PlanLayout(), graph, config={"channels_last": "always"})
    assert count(opt, "corner_pool_channels_last") == 1 and count(opt, *PERMUTES) == 2
    run_both(graph, opt, torch.randn(2, 8, 6, 6), atol=1e-4, rtol=1e-4)


def _cuda_conv(dtype="float16", groups=1):
    x, w = kiln.symbol([1, 8, 6, 6], dtype, "cuda"), kiln.symbol([8, 8 // groups, 3, 3], dtype, "cuda")
    return ops.conv2d(x, w, None, padding=1, groups=groups).trace[0]


@pytest.fixture
def hopper(monkeypatch):
    """The CUDA backend reports an sm_90 device (no GPU is used: nodes are only planned)."""
    monkeypatch.setitem(BACKENDS, "cuda", dataclasses.replace(BACKENDS["cuda"], unavailable=lambda: None,
                                                              arch=lambda device: 90))
    return monkeypatch


def _channels_last_templates(monkeypatch, fake: bool):
    """While the test runs, the only channels-last convolution template is a fake one for
    sm_90 that takes ungrouped convolutions (`fake`), or there is none."""
    choose = importlib.import_module("kiln.schedule.choose")
    contributed = choose.templates_for
    template = Template("fake_conv_sm90", ("conv2d_channels_last",), "cuda", render=None, min_arch=90,
                        applies=lambda task: task.inputs[0].shape[-1] % 8 == 0
                        and task.inputs[1].shape[-1] == task.inputs[0].shape[-1])

    def replaced(op, target, arch=None, plugins=None):
        if (op, target) == ("conv2d_channels_last", "cuda"):
            return [template] if fake and (arch is None or template.min_arch <= arch) else []
        return contributed(op, target, arch, plugins)

    monkeypatch.setattr(choose, "templates_for", replaced)
    monkeypatch.setattr(importlib.import_module("kiln.schedule.session"), "templates_for", replaced)


def test_auto_takes_16bit_cuda_convolutions_that_a_template_takes(hopper):
    conv = _cuda_conv()
    _channels_last_templates(hopper, fake=False)
    assert not runs(conv, "auto")            # no channels-last template contributed
    _channels_last_templates(hopper, fake=True)
    hopper.setitem(BACKENDS, "cuda", dataclasses.replace(BACKENDS["cuda"], arch=lambda device: 80))
    assert not runs(conv, "auto")            # an sm_80 device: the template is sm_90's
    hopper.setitem(BACKENDS, "cuda", dataclasses.replace(BACKENDS["cuda"], arch=lambda device: 90))
    assert runs(conv, "auto") and runs(conv, "always")
    assert not runs(conv, "never")
    assert not runs(_cuda_conv("float32"), "auto")
    assert not runs(_cuda_conv(groups=2), "auto")       # the fake template declines it
    assert runs(_cuda_conv("bfloat16"), "auto")

    def cuda(*shape):
        return kiln.symbol(shape, "float16", "cuda")

    x, w, depthwise = cuda(1, 8, 6, 6), cuda(8, 8, 3, 3), cuda(8, 1, 3, 3)
    h = ops.relu(ops.conv2d(x, w, None, padding=1))
    plain = kiln.trace_from(ops.conv2d(h, w, None, padding=1), [x, w])
    mixed = kiln.trace_from(ops.conv2d(h, depthwise, None, padding=1, groups=8), [x, w, depthwise])
    planned = apply(PlanLayout(), plain)
    assert [n.definition.name for n in planned.nodes].count("conv2d_channels_last") == 2
    assert apply(PlanLayout(), mixed) is mixed             # no conversions around the depthwise one


def test_auto_plans_cuda_graphs_without_a_gpu(monkeypatch):
    # regression: planning asked the absent GPU for its architecture (the NVRTC checks plan
    # graphs of CUDA symbols on machines without one)
    def no_arch(device):
        raise AssertionError("the architecture of an absent GPU was asked for")

    monkeypatch.setitem(BACKENDS, "cuda", dataclasses.replace(
        BACKENDS["cuda"], unavailable=lambda: "no GPU in this test", arch=no_arch))
    _channels_last_templates(monkeypatch, fake=False)
    assert not runs(_cuda_conv(), "auto")
    _channels_last_templates(monkeypatch, fake=True)
    assert runs(_cuda_conv(), "auto")        # a template for some architecture


def test_auto_leaves_cpu_graphs_alone_and_the_config_turns_the_pass_off():
    x = kiln.symbol([1, 3, 8, 8])
    graph = kiln.trace_from(ops.relu(ops.conv2d(x, const(8, 3, 3, 3), const(8), padding=1)))
    assert apply(PlanLayout(), graph) is graph             # float32 on the CPU: unchanged
    half = kiln.trace_from(ops.conv2d(kiln.symbol([1, 8, 8, 8], "float16"),
                                      kiln.from_torch(torch.randn(8, 8, 3, 3).half()), None))
    assert apply(PlanLayout(), half) is half               # float16 on the CPU: unchanged
    assert apply(PlanLayout(), graph, config={"channels_last": "never"}) is graph
    assert apply(PlanLayout(), graph, config={"channels_last": "always"}) is not graph
    with pytest.raises(ValueError, match="channels_last"):
        apply(PlanLayout(), graph, config={"channels_last": "yes"})


def test_elementwise_means_same_index_reads_only():
    x = kiln.symbol([2, 3, 4, 5])
    assert is_elementwise(ops.add(x, const(1, 3, 1, 1)).trace[0])
    assert is_elementwise(ops.mul(ops.relu(x), const(5)).trace[0])
    assert is_elementwise(ops.hardswish(x).trace[0])
    assert not is_elementwise(ops.tril(kiln.symbol([4, 4])).trace[0])       # reads its index
    assert not is_elementwise(ops.flip(x, [1]).trace[0])
    assert not is_elementwise(ops.expand(kiln.symbol([1, 3, 4, 5]), [2, 3, 4, 5]).trace[0])
    assert not is_elementwise(ops.softmax(x, 1).trace[0])


@pytest.mark.parametrize("stores", ["any", "nhwc"])
def test_kernels_of_a_basic_block_under_a_channels_last_template(monkeypatch, stores):
    # a template takes conv2d_channels_last on the CPU here, as conv_sm90 will on CUDA: no
    # prologue joins it, so the input's conversion is a kernel of its own; the output's is
    # the last convolution's epilogue where the template takes it. Regression ("nhwc"): where
    # the template declined the group conv + add + relu + permute, all four became kernels of
    # their own; now only the conversion does
    choose = importlib.import_module("kiln.schedule.choose")
    contributed = choose.templates_for
    def applies(task):
        return stores == "any" or task.outputs[0].shape[-1] == task.inputs[1].shape[0]

    fake = Template("fake_conv_template", ("conv2d_channels_last",), "cpu", render=None, applies=applies)

    def with_fake(op, target, arch=None, plugins=None):
        return [fake] if (op, target) == ("conv2d_channels_last", "cpu") else contributed(op, target, arch, plugins)

    monkeypatch.setattr(choose, "templates_for", with_fake)
    monkeypatch.setattr(importlib.import_module("kiln.schedule.session"), "templates_for", with_fake)
    x = kiln.symbol([2, 8, 5, 6])
    h = ops.relu(ops.conv2d(x, const(8, 8, 3, 3), const(8), padding=1))
    graph = kiln.trace_from(ops.relu(ops.add(ops.conv2d(h, const(8, 8, 3, 3), const(8), padding=1), x)))
    with PassContext(config={"channels_last": "always"}):
        opt = kiln.passes.optimize(graph)
    kernels = [repr(n.fused_graph) if isinstance(n, FusedOperator) else n.name for n in opt.nodes]
    if stores == "any":
        assert kernels == ["Permute", "FlowGraph(Conv2dChannelsLast, Relu)",
                           "FlowGraph(Conv2dChannelsLast, Add, Relu, Permute)"]
    else:
        assert kernels == ["Permute", "FlowGraph(Conv2dChannelsLast, Relu)",
                           "FlowGraph(Conv2dChannelsLast, Add, Relu)", "Permute"]
    monkeypatch.undo()
    run_both(graph, opt, torch.randn(2, 8, 5, 6), atol=1e-4, rtol=1e-4)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_resnet_structure_on_cuda(dtype):
    torch.manual_seed(0)
    model = randomized(TinyResNet()).cuda().to(dtype)
    tol = 3e-2 if dtype == torch.float16 else 1e-1
    graph = compiled(model, torch.randn(2, 3, 32, 32, device="cuda", dtype=dtype), atol=tol, rtol=tol)
    assert count(graph, "conv2d_channels_last") == 13 and count(graph, *PERMUTES) == 1


@pytest.mark.parametrize("model,size", [(TinyMobileNet, 29), (TinyConvNeXt, 36)], ids=["mobilenet", "convnext"])
def test_depthwise_networks_run_channels_last_with_one_conversion(model, size):
    # squeeze-excitation (pool, 1x1 convolutions on (N, C, 1, 1), gate, product), hardswish,
    # SiLU, ConvNeXt's permutes around its layer norms and MLPs, layer scales of both shapes:
    # the input's conversion is the only one, the pooled head leaves by a reshape
    torch.manual_seed(0)
    graph = compiled(randomized(model()), torch.randn(2, 3, size, size + 2))
    convs = [n for n in members(graph) if n.definition.name == "conv2d_channels_last"]
    assert count(graph, "conv2d") == 0 and any(n.attrs["groups"] > 1 for n in convs)
    assert count(graph, *PERMUTES) == 1


def test_auto_takes_the_convolutions_conv_depthwise_nhwc_takes(hopper):
    # the built-in templates decide: conv_sm90 the ungrouped ones, conv_depthwise_nhwc
    # depthwise and small-group ones (G channels a group dividing its 8-channel packs)
    def conv(c, o, g, k=3, dtype="float16"):
        x, w = kiln.symbol([1, c, 9, 7], dtype, "cuda"), kiln.symbol([o, c // g, k, k], dtype, "cuda")
        return ops.conv2d(x, w, None, padding=k // 2, groups=g).trace[0]

    assert runs(conv(24, 24, 24), "auto") and runs(conv(40, 40, 40, 5, "bfloat16"), "auto")
    assert runs(conv(96, 96, 96, 7), "auto") and runs(conv(32, 32, 8), "auto")
    assert runs(conv(20, 20, 20), "auto")                # 4-channel packs
    assert not runs(conv(24, 24, 24, dtype="float32"), "auto")
    assert not runs(conv(32, 32, 2), "auto")             # 16 channels a group
    assert not runs(conv(16, 32, 16), "auto")            # a channel multiplier
    assert not runs(conv(16, 16, 16, 9), "auto")         # a 9x9 filter

    def cuda(*shape):
        return kiln.symbol(shape, "float16", "cuda")

    x, expand, project = cuda(1, 16, 9, 7), cuda(48, 16, 1, 1), cuda(16, 48, 1, 1)
    squeeze, excite = cuda(12, 48, 1, 1), cuda(48, 12, 1, 1)
    h = ops.hardswish(ops.conv2d(x, expand, None))

    def block(depthwise, groups):
        d = ops.relu(ops.conv2d(h, depthwise, None, padding=1, groups=groups))
        gate = ops.conv2d(ops.relu(ops.conv2d(ops.adaptive_avg_pool2d(d, 1), squeeze, None)), excite, None)
        graph = kiln.trace_from(ops.add(x, ops.conv2d(ops.mul(d, ops.hardsigmoid(gate)), project, None)),
                                [x, expand, depthwise, project, squeeze, excite])
        return graph, apply(PlanLayout(), graph)

    graph, planned = block(cuda(48, 1, 3, 3), 48)          # MobileNetV3's, squeeze-excitation and all
    assert count(planned, "conv2d_channels_last") == 5 and count(planned, "conv2d") == 0
    assert count(planned, *PERMUTES) == 2                  # the input's and the output's (the weights: reshapes)
    assert [n.inputs[1].shape for n in planned.nodes if n.definition.name == "conv2d_channels_last"] == \
        [(48, 1, 1, 16), (48, 3, 3, 1), (12, 1, 1, 48), (48, 1, 1, 16), (16, 1, 1, 48)]
    graph, planned = block(cuda(48, 16, 3, 3), 3)         # no channels-last template for 16 a group
    assert planned is graph


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("model,size", [(TinyMobileNet, 29), (TinyConvNeXt, 36)], ids=["mobilenet", "convnext"])
def test_depthwise_networks_on_cuda_by_default(model, size, dtype):
    # "auto": conv_sm90 takes the ungrouped convolutions, conv_depthwise_nhwc the depthwise ones
    torch.manual_seed(0)
    net = randomized(model()).cuda().to(dtype)
    tol = 3e-2 if dtype == torch.float16 else 1e-1
    graph = compiled(net, torch.randn(2, 3, size, size + 2, device="cuda", dtype=dtype), mode="auto", atol=tol,
                     rtol=tol)
    assert count(graph, "conv2d") == 0 and feature_map_permutes(graph) == 1
