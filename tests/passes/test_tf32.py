"""The TF32 permission (`kiln.passes.tf32`): float32 matrix products on CUDA are marked
`allow_tf32` when the config allows it, as torch.compile's backend sets it from
`torch.backends.cuda.matmul.allow_tf32`, and float32 convolutions when `allow_tf32_convolution`
does (from `torch.backends.cudnn.allow_tf32`), which also lets layout planning run them
channels-last; nothing else changes."""
import pytest
import torch

import kiln
from kiln.frontend.torch.config import dynamo_config
from kiln.graph import TF32, Traits
from kiln.passes import AllowTF32, PassContext
from kiln.passes.tf32 import permissions

ops = kiln.ops


def _graph(device, dtype="float32"):
    x, w, y = (kiln.symbol(s, dtype, device) for s in ([5, 8], [6, 8], [8, 3]))
    return kiln.trace_from([ops.linear(x, w), ops.matmul(x, y), ops.relu(x)], [x, w, y])


def _marked(graph) -> list:
    return [(n.name, n.attrs.get("allow_tf32", False)) for n in graph.nodes]


def test_float32_products_on_cuda_are_marked_only_when_allowed():
    graph = _graph("cuda")
    with PassContext(required_passes=["allow_tf32"], config={"allow_tf32": True}):
        assert _marked(AllowTF32()(graph)) == [("Linear", True), ("Matmul", True), ("Relu", False)]
    with PassContext(required_passes=["allow_tf32"], config={"allow_tf32": False}):
        assert _marked(AllowTF32()(graph)) == [("Linear", False), ("Matmul", False), ("Relu", False)]


def test_cpu_and_16_bit_products_are_left_alone():
    for graph in (_graph("cpu"), _graph("cuda", "float16")):
        with PassContext(required_passes=["allow_tf32"], config={"allow_tf32": True}):
            assert not any(flag for _, flag in _marked(AllowTF32()(graph)))


def test_the_backend_takes_torchs_flag_and_the_cpu_result_stays_float32():
    previous = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = True
        assert dynamo_config.resolve().allow_tf32
        assert not dynamo_config.resolve({"allow_tf32": False}).allow_tf32
        x, w = torch.randn(7, 33), torch.randn(9, 33)
        torch._dynamo.reset()
        out = torch.compile(torch.nn.functional.linear, backend="kiln")(x, w)
        torch.testing.assert_close(out, x @ w.t(), rtol=1e-5, atol=1e-5)   # float32 (TF32 would be ~1e-3 off)
        torch.backends.cuda.matmul.allow_tf32 = False
        assert not dynamo_config.resolve().allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous
        torch._dynamo.reset()


def _conv_graph(device="cuda", dtype="float32", channels=3):
    x, w, y = (kiln.symbol(s, dtype, device) for s in ([2, channels, 10, 10], [16, channels, 3, 3], [4, 8]))
    out = ops.relu(ops.conv2d(x, w, padding=1))
    return kiln.trace_from([out, ops.matmul(y, ops.transpose(y, 0, 1))], [x, w, y])


def test_each_product_follows_its_own_permission():
    """Convolutions follow `allow_tf32_convolution` (cuDNN's flag), matrix products `allow_tf32`."""
    graph = _conv_graph()

    def marks(**config):
        with PassContext(required_passes=["allow_tf32"], config=config):
            return [mark for mark in _marked(AllowTF32()(graph)) if mark[0] in ("Conv2d", "Matmul")]

    assert marks(allow_tf32=False, allow_tf32_convolution=True) == [("Conv2d", True), ("Matmul", False)]
    assert marks(allow_tf32=True, allow_tf32_convolution=False) == [("Conv2d", False), ("Matmul", True)]
    assert marks(allow_tf32=True, allow_tf32_convolution=True) == [("Conv2d", True), ("Matmul", True)]


def test_permissions_name_the_settings_a_graph_depends_on():
    assert permissions(_conv_graph()) == {"allow_tf32", "allow_tf32_convolution"}
    assert permissions(_conv_graph("cpu")) == frozenset()
    assert permissions(_conv_graph("cuda", "float16", 8)) == frozenset()
    x = kiln.symbol([2, 8], "float32", "cuda")
    assert permissions(kiln.trace_from(ops.relu(x), [x])) == frozenset()


def test_the_trait_names_its_permission_and_true_is_the_matmul_one():
    registry = kiln.plugins.registry()
    assert registry.operator("matmul").traits.tf32 is TF32.MATMUL
    assert registry.operator("conv2d").traits.tf32 is TF32.CONVOLUTION
    assert registry.operator("conv2d_channels_last").traits.tf32 is TF32.CONVOLUTION
    assert Traits(tf32=True).tf32 is TF32.MATMUL and Traits(tf32=False).tf32 is None


def _planned(config):
    with PassContext(config={"channels_last": "auto", **config}):
        graph = kiln.graph.optimize(_conv_graph())
    return [(n.task.name, n.task.attrs.get("allow_tf32", False)) for n in graph.nodes
            if "conv2d" in n.task.name]


def test_float32_convolutions_run_channels_last_on_tf32_only_when_allowed():
    """With TF32 allowed a float32 CUDA convolution runs channels-last (the Hopper implicit GEMM
    takes it; graphs of CUDA symbols are planned for any architecture without a GPU), its
    permission carried to its channels-last form; without, it stays as it was: NCHW, float32."""
    assert _planned({"allow_tf32_convolution": True}) == [("conv2d_channels_last", True)]
    assert _planned({"allow_tf32_convolution": False}) == [("conv2d", False)]
    assert _planned({"allow_tf32": True}) == [("conv2d", False)]


def test_rounding_to_tf32_is_to_nearest_ties_away_and_keeps_specials():
    from kiln.passes.tf32 import rounded_to_tf32
    step = 2.0 ** -10                                   # TF32's spacing in [1, 2)
    values = torch.tensor([1.0, 1 + step / 2, 1 + step / 2 - 2 ** -23, 1 + 0.75 * step, -(1 + step / 2), 0.0,
                           float("inf"), -float("inf"), float("nan"), 3.4028234e38])
    got = rounded_to_tf32(values)
    assert got[:6].tolist() == [1.0, 1 + step, 1.0, 1 + step, -(1 + step), 0.0]
    assert got[6] == float("inf") and got[7] == -float("inf") and got[8].isnan() and got[9] == float("inf")
    x = torch.randn(10000, dtype=torch.float64).float()
    r = rounded_to_tf32(x)
    assert ((r.view(torch.int32) & 0x1FFF) == 0).all()
    assert ((r - x).abs() <= x.abs() * 2 ** -11).all()
    assert abs(((r.double() - x.double()) / x.double()).mean().item()) < 2e-5    # no bias: truncation has 3.5e-4


@pytest.mark.cuda
def test_a_convolutions_constant_factors_are_rounded_to_tf32_and_the_rest_left_alone():
    """Where a convolution runs on TF32, its constant factors (the weight) are replaced by
    copies rounded to nearest, so that the tensor cores' truncation of the low bits changes
    nothing; a constant that is no factor (the bias) stays as it was, and so do a matrix
    product's weights (a rounded copy would hold every weight twice). (A CUDA graph's
    constants live on the GPU.)"""
    from kiln.passes.tf32 import rounded_to_tf32
    g = torch.Generator().manual_seed(3)
    w, b, lw = (torch.randn(*s, generator=g).cuda() for s in ((6, 8, 3, 3), (6,), (6, 8)))
    x, v = kiln.symbol([2, 8, 5, 5], "float32", "cuda"), kiln.symbol([5, 8], "float32", "cuda")
    wc, bc, lc = kiln.from_torch(w), kiln.from_torch(b), kiln.from_torch(lw)
    graph = kiln.trace_from([ops.conv2d(x, wc, bc, 1, 1), ops.linear(v, lc)], [x, v])
    config = {"allow_tf32": True, "allow_tf32_convolution": True}
    with PassContext(required_passes=["allow_tf32"], config=config):
        conv, linear = AllowTF32()(graph).nodes
    assert conv.attrs["allow_tf32"] and linear.attrs["allow_tf32"]
    assert torch.equal(conv.inputs[1].torch(), rounded_to_tf32(w)) and not torch.equal(rounded_to_tf32(w), w)
    assert conv.inputs[2] is bc and torch.equal(wc.torch(), w) and linear.inputs[1] is lc
    with PassContext(required_passes=["allow_tf32"], config={"allow_tf32_convolution": False}):
        conv, _ = AllowTF32()(graph).nodes
    assert conv.inputs[1] is wc
