"""The fx interpreter: indexing, in-place methods and setitem, Python scalars and SymInts,
parameters as constants sharing memory."""
import operator

import pytest
import torch
from torch import nn

import kiln
from kiln.frontend.torch import Interpreter, kiln_backend

from frontend_support import compile_and_compare

X = torch.arange(2 * 3 * 4 * 5, dtype=torch.float32).reshape(2, 3, 4, 5)
INDICES = [
    (1,), (-1, 2), (slice(None), None, slice(1, 3)), (Ellipsis, 2), (Ellipsis, None, slice(0, 5, 2)),
    (0, Ellipsis, slice(-3, None)), (None, 1, slice(None), -2),
    (torch.tensor([1, 0, 1]),), (slice(None), torch.tensor([[2, 0], [1, 1]])),
    (slice(None), torch.tensor([0, 2]), slice(None), torch.tensor([4, -1])),
    (torch.tensor([1, 0]), slice(None), torch.tensor([3, 0])), (slice(None), [2, 0]),
    (0, slice(None), torch.tensor([1, 3])),
]


@pytest.mark.parametrize("index", INDICES, ids=str)
def test_getitem(index):
    tensors = [i for i in index if isinstance(i, torch.Tensor)]

    def fn(x, *ts):
        it = iter(ts)
        return x[tuple(next(it) if isinstance(i, torch.Tensor) else i for i in index)]

    compile_and_compare(fn, X, *tensors)


@pytest.mark.parametrize("index,value", [
    ((0, slice(1, 3)), 7.0), ((Ellipsis, 1), "tensor"), ((slice(None), slice(0, 4, 2)), "row"),
    ("mask", -1.0),
], ids=str)
def test_setitem(index, value):
    def fn(x):
        y = x * 2
        i = y > 100 if index == "mask" else index
        if value == "tensor":
            y[i] = x[..., 0] + 1
        elif value == "row":
            y[i] = torch.ones(5)
        else:
            y[i] = value
        return y + 1

    compile_and_compare(fn, X)


@pytest.mark.parametrize("index", [i for i in INDICES if any(isinstance(t, torch.Tensor) for t in i)],
                         ids=str)
def test_setitem_at_index_tensors(index):
    """A scalar, then a row broadcast over the region (one value per position, even where an
    index repeats)."""
    tensors = [i for i in index if isinstance(i, torch.Tensor)]
    row = torch.randn(X[index].shape[-1])

    def fn(x, row, *ts):
        it = iter(ts)
        i = tuple(next(it) if isinstance(t, torch.Tensor) else t for t in index)
        y = x * 2
        z = x + 1
        y[i] = -1.5
        z[i] = row
        return y, z

    compile_and_compare(fn, X, row, *tensors)

def test_inplace_methods_and_operators_rebind_the_tensor():
    def fn(x, y):
        h = x * 1
        h.add_(y)
        h.mul_(2).relu_()
        h += 1
        return torch.nn.functional.relu(h - 3, inplace=True), h

    compile_and_compare(fn, torch.randn(3, 4), torch.randn(4))


def test_python_scalars_and_symints():
    def fn(x):
        n, d = x.shape
        return x.view(n * d).sum() / x.size(0) + x.reshape(d, -1).t() * (n + 1)

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="kiln", dynamic=True)
    for shape in ((2, 3), (4, 5)):
        x = torch.randn(shape)
        torch.testing.assert_close(compiled(x), fn(x))


def test_parameters_are_constants_sharing_memory():
    model = nn.Linear(4, 3).eval()
    capture, _ = compile_and_compare(model, torch.randn(2, 4))
    graph = next(iter(capture.compiled[0].graphs.values())).graph
    pointers = {t.torch().data_ptr() for t in graph.constants}
    assert model.weight.data_ptr() in pointers and model.bias.data_ptr() in pointers
    with torch.no_grad():
        model.weight.mul_(2)  # the compiled graph reads the same memory
    x = torch.randn(2, 4)
    torch.testing.assert_close(torch.compile(model, backend=capture)(x), model(x).detach())


def test_interpreter_records_a_flow_graph_from_symbolic_inputs():
    gm = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    x = kiln.symbol((2, 4))
    out = Interpreter(gm).run([x])
    graph = kiln.trace_from(out, [x])
    assert [n.name for n in graph.nodes] == ["Linear", "Relu"]
    assert operator.getitem not in [n.target for n in gm.graph.nodes]


def test_inputs_changed_in_place_are_written_back():
    def fn(x, y):
        x.add_(y)
        x[0] = 0.0
        return x * 2

    x, y = torch.randn(3, 4), torch.randn(4)
    expected_x = x.clone()
    expected = fn(expected_x, y)
    torch._dynamo.reset()
    actual = torch.compile(fn, backend="kiln", fullgraph=True)(x, y)
    torch.testing.assert_close(actual, expected)
    torch.testing.assert_close(x, expected_x)


def test_dunder_methods_and_diff_as_transformers_uses_them():
    """transformers' mask code calls `Tensor.__eq__` and `torch.diff` (bool and float)."""
    class Masks(nn.Module):
        def forward(self, x, ids):
            same = ids.__eq__(ids.flip(-1)).__and__(ids.__gt__(1))
            steps = torch.diff(ids > 2, dim=-1).float().sum(-1, keepdim=True)
            return torch.diff(x, n=2, dim=1, prepend=x[:, :1]) * same[:, 1:] + steps

    ids = torch.randint(0, 5, (3, 6))
    compile_and_compare(Masks(), torch.randn(3, 6), ids)

    graph = torch.fx.Graph()                # dynamo records some as call_method nodes
    x, i = graph.placeholder("x"), graph.placeholder("ids")
    same = graph.call_method("__and__", (graph.call_method("__eq__", (i, 2)),
                                         graph.call_method("__gt__", (i, 1))))
    graph.output(graph.call_method("__mul__", (x, graph.call_method("float", (same,)))))
    gm = torch.fx.GraphModule(nn.Module(), graph)
    inputs = [torch.randn(3, 6), ids]
    torch.testing.assert_close(kiln_backend(gm, inputs)(*inputs), gm(*inputs))
