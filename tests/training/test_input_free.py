"""`recompute_input_free`: a saved value that depends on no input of the forward is computed by
the backward instead (so that it folds to a constant there too), and a random one stays saved.
Checked on AOTAutograd's own partition of small functions, with gradients against eager.
`build_where_used`: a value built from nothing on the CPU and copied to a GPU is built on the GPU
(a graph of fake tensors; tests/cuda/test_model_rules_cuda.py runs one)."""
import torch
from functorch.compile import aot_function, make_boxed_func, min_cut_rematerialization_partition

from kiln.frontend.torch.input_free import build_where_used, recompute_input_free


def _aot(fn):
    """fn through AOTAutograd with the min-cut partition followed by `recompute_input_free`;
    the forward and backward graphs are kept in `graphs`."""
    graphs = {}

    def partition(joint, inputs, *, num_fwd_outputs, **options):
        forward, backward = min_cut_rematerialization_partition(joint, inputs, num_fwd_outputs=num_fwd_outputs,
                                                                **options)
        graphs["saved_before"] = len(next(iter(forward.graph.find_nodes(op="output"))).args[0]) - num_fwd_outputs
        return recompute_input_free(forward, backward, num_fwd_outputs)

    def keep(name):
        def compiler(gm, _):
            graphs[name] = gm
            return make_boxed_func(gm)
        return compiler
    return aot_function(fn, fw_compiler=keep("forward"), bw_compiler=keep("backward"), partition_fn=partition), graphs


def _positions_mask(n):
    pos = torch.arange(n)
    return (torch.cumsum(pos, 0) % 3 == 0) & (pos > 0)


def test_a_mask_from_positions_is_computed_by_the_backward():
    f, graphs = _aot(lambda x: (x * _positions_mask(x.shape[-1])).sin())
    x = torch.randn(4, 9, requires_grad=True)
    y = f(x)
    y.backward(torch.ones_like(y))
    want = torch.cos(x.detach() * _positions_mask(9)) * _positions_mask(9)
    torch.testing.assert_close(x.grad, want)
    backward_inputs = [n.name for n in graphs["backward"].graph.find_nodes(op="placeholder")]
    saved_after = len(next(iter(graphs["forward"].graph.find_nodes(op="output"))).args[0]) - 1
    assert graphs["saved_before"] == saved_after + 1, "the mask is no longer saved"
    assert any(n.target == torch.ops.aten.cumsum.default for n in graphs["backward"].graph.nodes)
    assert len(backward_inputs) == saved_after + 1      # the saved values and the output's gradient


def test_random_values_stay_saved():
    f, graphs = _aot(lambda x: x * (torch.rand(x.shape[-1]) > 0.5))
    x = torch.randn(4, 9, requires_grad=True)
    y = f(x)
    y.backward(torch.ones_like(y))
    torch.testing.assert_close(x.grad, (y != 0).float())
    assert not any("rand" in str(n.target) for n in graphs["backward"].graph.nodes)


def test_a_value_built_from_nothing_is_built_where_it_is_used():
    """numpy's `x + np.random.uniform(2, 3, n)` moved to x's GPU, as AOTAutograd writes it: the
    draw's `empty` and everything after it up to the copy go to the GPU. A draw that a CPU node
    reads as well stays on the CPU."""
    aten, mode = torch.ops.aten, torch._subclasses.FakeTensorMode()
    graph = torch.fx.Graph()
    x, y = graph.placeholder("x"), graph.placeholder("y")
    gpu = torch.device("cuda:0")

    def draw_and_copy():
        empty = graph.call_function(aten.empty.memory_format, ([5],), {"dtype": torch.float64,
                                                                       "device": torch.device("cpu")})
        drawn = graph.call_function(aten.uniform.default, (empty, 2.0, 3.0))
        moved = graph.call_function(aten._to_copy.default, (drawn,), {"dtype": torch.float32, "device": gpu})
        return [empty, drawn], moved

    (empty, drawn), moved = draw_and_copy()
    (shared_empty, shared), shared_moved = draw_and_copy()
    on_cpu = graph.call_function(aten.add.Tensor, (y, shared))
    on_gpu = graph.call_function(aten.add.Tensor, (moved, shared_moved))
    graph.output((graph.call_function(aten.add.Tensor, (x, on_gpu)), on_cpu))
    with mode:
        for node in graph.nodes:
            if node.op != "output":
                on = "cpu" if node in (y, empty, drawn, shared_empty, shared, on_cpu) else "cuda"
                node.meta["val"] = torch.empty(5, device=on)
    build_where_used(torch.fx.GraphModule(torch.nn.Module(), graph))
    assert empty.kwargs["device"] == gpu and empty.meta["val"].device == drawn.meta["val"].device == gpu
    assert shared_empty.kwargs["device"] == torch.device("cpu")
    assert {n.meta["val"].device.type for n in (y, shared_empty, shared, on_cpu)} == {"cpu"}
