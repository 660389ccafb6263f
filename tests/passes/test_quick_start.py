"""The quick-start's "Optimize flow graph": matmul and add become one fused operator."""
import torch

import kiln


def test_quick_start_fuses_matmul_and_add():
    a, b, c = kiln.randn([2, 3]), kiln.randn([3, 2]), kiln.randn([2])
    x = kiln.symbol_like(a)
    graph = kiln.trace_from(kiln.ops.matmul(x, b) + c)
    opt = kiln.graph.optimize(graph)
    assert str(opt) == (
        "Graph(x: float32[2, 3][cpu]){\n"
        "  c = Constant(float32[3, 2][cpu])\n"
        "  c_1 = Constant(float32[2][cpu])\n"
        "  x_1: float32[2, 2][cpu] = FusedMatmul(x, c, c_1, fused_graph=FlowGraph(Matmul, Add), anchor=0)\n"
        "  return x_1\n"
        "}")
    expected = a.torch() @ b.torch() + c.torch()
    torch.testing.assert_close(opt(a).torch(), expected)
    torch.testing.assert_close(graph(a).torch(), expected)
