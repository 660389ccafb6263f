"""The NCHW depthwise convolution template (`conv_depthwise`) without a GPU: it takes a depthwise
conv2d whose output is its own (N, C, OH, OW) one or a permutation of it, epilogues included,
reading which output axis is which from the index arithmetic, and declines a task whose
epilogue reshapes that output (SegFormer's, Twins-SVT's, XCiT's and CoaT-lite's depthwise
convolutions are followed by `flatten(2)`): such a task gets another program, which NVRTC
compiles, where the template once failed to render it (its output has no (OH, OW) to unpack) or
rendered pixels at the wrong places (a transposed square output)."""
import pytest

import kiln
from kiln.graph import optimize, trace_from
from kiln.passes import FusedOperator
from kiln.runtime import cuda as rt
from kiln.schedule import schedules_for
from kiln.schedule.choose import check_nvrtc, choose
from kiln_ops_builtin.templates import conv_depthwise

ops = kiln.ops
ARCHS = ("sm_80", "sm_90")
needs_nvrtc = pytest.mark.skipif(not rt.nvrtc_available(), reason="cuda-bindings / nvidia-cuda-nvrtc "
                                 "not installed: pip install 'kiln-core[cuda]'")

EPILOGUES = {
    "flatten": lambda y: ops.flatten(y, 2),
    "flatten_transpose": lambda y: ops.transpose(ops.flatten(y, 2), 1, 2),
}


def _depthwise(epilogue, size=16, channels=64, dtype="float32"):
    """The task of a depthwise 3x3 conv2d (bias, padding 1) with every node of `epilogue(y)`
    fused after it, as the fusion passes would build it."""
    x, w, b = (kiln.symbol(s, dtype, "cuda") for s in [(2, channels, size, size), (channels, 1, 3, 3), (channels,)])
    graph = trace_from(epilogue(ops.conv2d(x, w, b, 1, 1, 1, channels)), [x, w, b])
    return FusedOperator(graph.nodes, [x, w, b], graph.outputs, 0).task


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_takes_a_depthwise_conv_with_an_elementwise_epilogue(dtype):
    assert "conv_depthwise" in [t.name for t in schedules_for(_depthwise(ops.relu, dtype=dtype), "cuda")]


@pytest.mark.parametrize("name", EPILOGUES)
def test_declines_an_epilogue_that_moves_the_pixels(name):
    assert "conv_depthwise" not in [t.name for t in schedules_for(_depthwise(EPILOGUES[name]), "cuda")]


def test_takes_a_transposed_square_output_with_its_rows_and_columns_swapped():
    task = _depthwise(lambda y: ops.transpose(y, 2, 3))
    assert schedules_for(task, "cuda")[0].name == "conv_depthwise"
    out = task.outputs[0]
    lowered_axes = conv_depthwise._geometry(task)[-1]
    assert [a.name for a in lowered_axes] == ["i0", "i1", "i3", "i2"], "row is the output's last axis"
    assert out.shape == (2, 64, 16, 16)


@needs_nvrtc
@pytest.mark.parametrize("name", [*EPILOGUES, "transpose_square"])
def test_the_program_chosen_compiles(name):
    task = _depthwise(EPILOGUES.get(name, lambda y: ops.transpose(y, 2, 3)))
    program = choose(task, "cuda")
    rt.compile_many([(rt.launch_source(program, arch), f"depthwise_{name}", program.arch_for(arch))
                     for arch in ARCHS])
    check_nvrtc(task, ARCHS)


@needs_nvrtc
def test_segformer_block_keeps_the_template_and_compiles():
    """SegFormer's DWConv (tokens to an image, depthwise conv, back to tokens), optimized: the
    convolution keeps `conv_depthwise` and every kernel's programs compile."""
    x, w, b = (kiln.symbol(s, "float32", "cuda") for s in [(2, 256, 64), (64, 1, 3, 3), (64,)])
    image = ops.reshape(ops.transpose(x, 1, 2), (2, 64, 16, 16))
    graph = optimize(trace_from(ops.transpose(ops.flatten(ops.conv2d(image, w, b, 1, 1, 1, 64), 2), 1, 2), [x, w, b]))
    anchors = [n.task for n in graph.nodes if n.task.name == "conv2d"]
    assert len(anchors) == 1 and schedules_for(anchors[0], "cuda")[0].name == "conv_depthwise"
    for node in graph.nodes:
        check_nvrtc(node.task, ARCHS)


@pytest.mark.parametrize("name, epilogue", [("flatten", lambda y: ops.flatten(y, 1, 2)),
                                            ("permute", lambda y: ops.permute(y, (0, 2, 1, 3)))])
def test_the_channels_last_templates_read_the_output_layout_too(name, epilogue):
    """`conv_depthwise_nhwc` and `conv_sm90` read the geometry from the output's index
    arithmetic (`match_conv_nhwc`): an output that is not (N, OH, OW, C) declines them."""
    x, w, b = (kiln.symbol(s, "float16", "cuda") for s in [(2, 16, 12, 64), (64, 3, 3, 1), (64,)])
    graph = trace_from(epilogue(ops.conv2d_channels_last(x, w, b, padding=1, groups=64)), [x, w, b])
    assert schedules_for(FusedOperator(graph.nodes, [x, w, b], graph.outputs, 0).task, "cuda") == []
