"""Inputs that share memory, one of them changed in place by the graph (`f(a, a[0])` where f
writes `a`): Kiln's compiled values cannot see the write through the other input, so such
calls run in PyTorch and give eager's values and errors, while calls whose inputs do not
overlap keep running Kiln's compiled graph."""
import pytest
import torch
from torch import nn

from kiln.frontend.torch import backend
from kiln.frontend.torch.backend import CompiledRun
from tests.frontend.frontend_support import Capture

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]

VIEWS = {
    "a[0]": lambda a: a[0],
    "a[1:]": lambda a: a[1:],
    "a.view(-1)": lambda a: a.view(-1),
    "a.t()": lambda a: a.t(),
}


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


@pytest.fixture
def compiled_runs(monkeypatch):
    """How many calls ran a graph Kiln compiled (a list, one entry per call)."""
    runs, run = [], CompiledRun.__call__
    monkeypatch.setattr(CompiledRun, "__call__", lambda self, args: runs.append(1) or run(self, args))
    return runs


def _write_first_read_second(a, b):
    return (a.add_(1), b * 1)[1]


def _write_second_read_first(a, b):
    return (b.mul_(2), a + 0)[1]


def _write_both(a, b):
    a.add_(1)
    b.mul_(2)
    return a + 0


def _check_like_eager(fn, a, view, compiled=None):
    """Call `fn(a, view(a))` compiled and eagerly on a copy of `a`: equal results, equal `a`."""
    eager_a = a.clone()
    expected = fn(eager_a, view(eager_a))
    actual = (compiled or torch.compile(fn, backend="kiln"))(a, view(a))
    torch.testing.assert_close(actual, expected)
    torch.testing.assert_close(a, eager_a)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("view", list(VIEWS.values()), ids=list(VIEWS))
@pytest.mark.parametrize("fn", [_write_first_read_second, _write_second_read_first, _write_both],
                         ids=lambda f: f.__name__)
def test_an_input_changed_in_place_is_seen_through_another_input(fn, view, device):
    _check_like_eager(fn, torch.randn(2, 3, device=device), view)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("view", list(VIEWS.values()), ids=list(VIEWS))
def test_a_graph_compiled_for_distinct_inputs_is_right_for_aliased_ones(view, device, compiled_runs):
    """Dynamo reuses the graph it compiled for two separate tensors when the second is a view
    of the first: the aliasing is found at call time."""
    capture = Capture()
    compiled = torch.compile(_write_first_read_second, backend=capture)
    a, b = torch.randn(2, 3, device=device), torch.randn_like(view(torch.randn(2, 3, device=device)))
    eager_a, eager_b = a.clone(), b.clone()
    torch.testing.assert_close(compiled(a, b), _write_first_read_second(eager_a, eager_b))
    assert compiled_runs == [1]
    _check_like_eager(_write_first_read_second, torch.randn(2, 3, device=device), view, compiled)
    assert len(capture.graphs) == 1, "dynamo compiled the aliased call anew: the reuse is not tested"
    assert compiled_runs == [1]


@pytest.mark.parametrize("device", DEVICES)
def test_a_copy_from_an_overlapping_input_raises_eagers_error(device):
    def fn(x, y):
        return x.copy_(y) * 1

    x = torch.randn(3, 3, device=device)
    eager_x = x.clone()
    message = "some elements of the input tensor and the written-to tensor refer to a single memory location"
    with pytest.raises(RuntimeError, match=message):
        fn(eager_x, eager_x.t())  # eager's error, which the compiled call must give
    with pytest.raises(RuntimeError, match=message):
        torch.compile(fn, backend="kiln")(x, x.t())
    torch.testing.assert_close(x, eager_x)


@pytest.mark.parametrize("device", DEVICES)
def test_inputs_that_do_not_overlap_run_the_compiled_graph(device, compiled_runs):
    """Separate storages, and disjoint parts of one storage, are compiled calls; only the call
    whose inputs overlap runs in PyTorch."""
    compiled = torch.compile(_write_first_read_second, backend="kiln")
    a = torch.randn(2, 3, device=device)
    torch.testing.assert_close(compiled(a[0], a[1]), a[1])
    torch.testing.assert_close(compiled(torch.randn(3, device=device), a[0]), a[0])
    assert compiled_runs == [1, 1]
    a = torch.randn(2, 3, device=device)
    eager_a = a.clone()
    expected = _write_first_read_second(eager_a[0], eager_a.view(-1)[1:4])
    torch.testing.assert_close(compiled(a[0], a.view(-1)[1:4]), expected)
    torch.testing.assert_close(a, eager_a)
    assert compiled_runs == [1, 1]


def test_the_same_tensor_twice_is_one_input_of_a_compiled_graph(compiled_runs):
    """Dynamo passes a tensor given twice once (the graph has one input): no aliasing is left for
    Kiln to find, and the graph is compiled."""
    capture = Capture()
    _check_like_eager(_write_first_read_second, torch.randn(2, 3), lambda a: a,
                      torch.compile(_write_first_read_second, backend=capture))
    assert [len(gm.graph.find_nodes(op="placeholder")) for gm in capture.graphs] == [1]
    assert compiled_runs == [1]


def test_graphs_that_change_no_input_skip_the_check(monkeypatch, compiled_runs):
    def unexpected(*args):
        raise AssertionError("the memory of inputs is checked though no input is changed")

    monkeypatch.setattr(backend, "shared_memory", unexpected)
    a = torch.randn(2, 3)
    torch.testing.assert_close(torch.compile(lambda a, b: a * 2 + b, backend="kiln")(a, a[0]),
                               a * 2 + a[0])
    assert compiled_runs == [1]


def test_an_input_changed_in_place_is_seen_through_a_buffer_it_shares_memory_with():
    """A buffer the graph only reads is a constant of the compiled graph: its memory is checked
    against the inputs the graph changes too."""
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("table", torch.randn(2, 3))

        def forward(self, x):
            x.add_(1)
            return self.table * 2

    model, eager = Model(), Model()
    eager.load_state_dict(model.state_dict())
    compiled = torch.compile(model, backend="kiln")
    torch.testing.assert_close(compiled(torch.randn(3)), eager(torch.randn(3)))
    torch.testing.assert_close(compiled(model.table[1]), eager(eager.table[1]))
    torch.testing.assert_close(model.table, eager.table)


def test_calls_run_in_pytorch_are_named_in_a_warning(monkeypatch):
    monkeypatch.setattr(backend, "_warned", set())
    a = torch.randn(2, 3)
    with pytest.warns(UserWarning, match=r"(?s)Kiln runs this call in PyTorch.*share memory.*"
                                         r"L\['a'\] \(changed in place\) and L\['b'\]"):
        torch.compile(_write_first_read_second, backend="kiln")(a, a[0])
