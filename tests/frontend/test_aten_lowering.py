"""What dynamo leaves in its graph for AOTAutograd to lower, which no torch-level rule maps
(numpy through `torch._numpy`, functorch's vmap): such a graph compiles from AOTAutograd's ATen
graph (`kiln.frontend.torch.backend._lowered`), against eager; an unmapped torch-level operator
in the same graph still raises, naming it."""
import numpy as np
import pytest
import torch

import kiln

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def scores(q, k):
    """CTRL's attention scores, scaled by numpy's square root of the head size."""
    return (q @ k.transpose(-1, -2)) / np.sqrt(k.shape[-1])


def batched_dot(x, y):
    """Mamba's per-row products through torch.vmap."""
    return torch.vmap(lambda a, b: (a * b).sum(-1) + a.amax())(x, y)


@pytest.mark.parametrize("fn, shapes", [(scores, [(2, 3, 5, 8), (2, 3, 7, 8)]),
                                        (batched_dot, [(4, 6, 9), (4, 6, 9)])], ids=["numpy", "vmap"])
def test_graphs_left_for_aotautograd_compile_from_its_aten_graph(fn, shapes):
    """Before: CTRL failed with `torch._dynamo.utils.wrapped_sqrt` unmapped, Mamba with
    functorch's `_add_batch_dim` and `aten.slice` unmapped."""
    inputs = [torch.randn(s) for s in shapes]
    with torch.no_grad():
        got = torch.compile(fn, backend="kiln")(*inputs)
    torch.testing.assert_close(got, fn(*inputs), rtol=1e-5, atol=1e-5)


def vits_lengths(x, mask, y):
    """VITS: a product of numpy's (its upsampling rates), and values written by a mask, where
    the values may be none (then the mask must select nothing)."""
    x = x.clone()
    x[mask] = y
    return x * np.prod([8, 8, 2, 2]) + x.prod(-1, keepdim=True)


@pytest.mark.parametrize("values", [0, 3])
def test_products_and_masked_values_in_a_lowered_graph(values):
    """Before: VITS's `np.prod` left `aten.prod` unmapped in the ATen graph, and `x[mask] = y`
    with y empty or of several values (ATen's index_put with a bool mask) was declined."""
    x, mask = torch.randn(2, 1, 17), torch.zeros(2, 1, 17, dtype=torch.bool)
    mask.view(-1)[[2, 20, 33]] = values > 0
    compiled = torch.compile(vits_lengths, backend="kiln")
    with torch.no_grad():
        y = torch.randn(values)
        torch.testing.assert_close(compiled(x, mask, y), vits_lengths(x, mask, y), rtol=1e-5, atol=1e-5)
        mask.view(-1)[5] = True         # one more than there are values: eager raises
        with pytest.raises(RuntimeError):
            vits_lengths(x, mask, y)
        with pytest.raises(RuntimeError, match=rf"value tensor of shape \[{values}\] cannot be broadcast to indexing "
                                               rf"result of shape \[{values + 1}\]"):
            compiled(x, mask, y)


def test_an_unmapped_operator_beside_them_still_raises_naming_it():
    def fn(q, k):
        return torch.special.bessel_j0(scores(q, k))
    with pytest.raises(Exception) as info:
        torch.compile(fn, backend="kiln")(torch.randn(2, 4, 8), torch.randn(2, 5, 8))
    error = getattr(info.value, "inner_exception", info.value)
    assert isinstance(error, kiln.UnmappedOperatorError), repr(info.value)
    assert "torch.special.bessel_j0" in str(error)


def test_functorch_builtins_lower_too():
    """Before: a graph of MRA's with `torch._C._functorch.set_inplace_requires_grad_allowed`
    nodes (functorch's builtins, in torch._C) failed as unmapped."""
    from kiln.frontend.torch.backend import kiln_backend
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.call_function(torch._C._functorch.set_inplace_requires_grad_allowed, (False,))
    y = graph.call_function(torch.mul, (x, 3.0))
    graph.call_function(torch._C._functorch.set_inplace_requires_grad_allowed, (True,))
    graph.output((graph.call_function(torch.exp, (y,)),))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    x = torch.randn(4, 5)
    with torch.no_grad():
        (got,) = kiln_backend(gm, [x])(x)
    torch.testing.assert_close(got, torch.exp(x * 3.0))


def test_numpy_random_numbers_are_seeded_from_torch():
    """Before: HuBERT's SpecAugment mask (`np.random.rand`, as dynamo traces it: ATen's
    `uniform`) failed as unmapped. Its numbers come from torch's generator, as Inductor's do: in
    [low, high), fresh at each call, the same after `torch.manual_seed`."""
    def draw(x):
        return x + torch.from_numpy(np.random.uniform(2.0, 3.0, size=x.shape[0])).to(x.dtype)

    fn, x = torch.compile(draw, backend="kiln"), torch.zeros(4000)
    torch.manual_seed(0)
    first, second = fn(x), fn(x)
    torch.manual_seed(0)
    assert torch.equal(fn(x), first) and not torch.equal(first, second)
    assert 2.0 <= first.min() and first.max() < 3.0 and abs(first.mean().item() - 2.5) < 0.02


def test_random_numbers_of_a_graph_without_inputs():
    """Before: a graph drawing numbers from constant sizes alone (HuBERT's mask, 
    `np.random.rand(4, 50)`, in a graph of its own) had no placeholder to put its seeds after."""
    fn = torch.compile(lambda: torch.from_numpy(np.random.rand(4, 50) < 0.5).sum(-1), backend="kiln")
    torch.manual_seed(1)
    first = fn()
    torch.manual_seed(1)
    assert torch.equal(fn(), first) and first.shape == (4,) and 0 < first.sum() < 200
