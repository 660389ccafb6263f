"""A node that would cost a template its group joins another group instead: SwiGLU's chunk of
a linear's result (two outputs, which no template's epilogue takes) fuses with the silu and
the multiply after it, rather than leaving all three unfused (`kiln.passes.fusion`)."""
import torch

import kiln

ops = kiln.ops


def test_chunk_after_a_linear_fuses_with_its_element_wise_consumers():
    torch.manual_seed(0)
    w = torch.randn(2 * 37, 29)
    x = kiln.symbol([3, 11, 29])
    gate, up = ops.chunk(ops.linear(x, kiln.from_torch(w)), 2, -1)
    graph = kiln.trace_from(ops.mul(ops.silu(gate), up), [x])
    opt = kiln.graph.optimize(graph)
    kernels = [n for n in opt.nodes if n.name != "Constant"]
    assert [n.name for n in kernels] == ["Linear", "FusedChunk"]
    assert repr(kernels[1].fused_graph) == "FlowGraph(Chunk, Silu, Mul)"
    v = torch.randn(3, 11, 29)
    g, u = (v @ w.T).chunk(2, -1)
    torch.testing.assert_close(opt(v).torch(), torch.nn.functional.silu(g) * u, atol=1e-4, rtol=1e-4)
