"""`recompute_input_free`: a saved value that depends on no input of the forward is computed by
the backward instead (so that it folds to a constant there too), and a random one stays saved.
Checked on AOTAutograd's own partition of small functions, with gradients against eager."""
import torch
from functorch.compile import aot_function, make_boxed_func, min_cut_rematerialization_partition

from kiln.frontend.torch.input_free import recompute_input_free


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
