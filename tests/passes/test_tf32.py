"""The TF32 permission (`kiln.passes.tf32`): float32 matrix products on CUDA are marked
`allow_tf32` when the config allows it, as torch.compile's backend sets it from
`torch.backends.cuda.matmul.allow_tf32`; nothing else changes."""
import torch

import kiln
from kiln.frontend.torch.config import dynamo_config
from kiln.passes import AllowTF32, PassContext

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
