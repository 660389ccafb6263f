"""Which saved values a consuming backward may reuse (`kiln.runtime.cuda_graph._lent_memory`),
without a GPU: private outputs of live lenders, whose memory no other input of the backward
views (it may be read through that input after the first one's last read; values side by side
in one storage share none), and not those of
a retired lender or of one whose values a saved_tensors_hooks saw."""
from types import SimpleNamespace

import pytest
import torch

from kiln.runtime import cuda_graph


@pytest.fixture
def lender(monkeypatch):
    """Every tensor is a private output of one lender (the test sets its state)."""
    graph = SimpleNamespace(retired=False, saved_under_hooks=False)
    monkeypatch.setattr(cuda_graph, "private_lender", lambda tensor: graph)
    return graph


def _compiled(n):
    return SimpleNamespace(inputs=list(range(10, 10 + n)))


def test_values_in_their_own_memory_are_reused(lender):
    a, b = torch.randn(8, 8), torch.randn(4)
    regions, lenders = cuda_graph._lent_memory(_compiled(2), [a, b], [0, 1])
    assert regions == {10: a, 11: b} and lenders == [lender]


def test_memory_another_input_views_is_left_alone(lender):
    base = torch.randn(64)
    a, b, c = base[:40], base[30:], torch.randn(4)
    regions, _ = cuda_graph._lent_memory(_compiled(3), [a, b, c], [0, 1, 2])
    assert list(regions) == [12], "a and b share bytes: neither is reused"
    regions, _ = cuda_graph._lent_memory(_compiled(3), [c, torch.randn(2), c], [0, 2])
    assert regions == {}, "one tensor at two positions is read through both"


def test_an_input_that_is_not_at_a_reused_position_still_protects_its_memory(lender):
    a = torch.randn(16)
    regions, _ = cuda_graph._lent_memory(_compiled(2), [a, a.view(4, 4)], [0])
    assert regions == {}


@pytest.mark.parametrize("state", ["retired", "saved_under_hooks"])
def test_a_retired_lender_or_one_a_hook_saw_lends_nothing(lender, state):
    setattr(lender, state, True)
    regions, lenders = cuda_graph._lent_memory(_compiled(1), [torch.randn(8)], [0])
    assert regions == {} and lenders == []


def test_values_side_by_side_in_one_storage_are_reused(lender):
    """A forward's saved values allocated together (`_side_by_side`) share a storage, not bytes."""
    base = torch.randn(64)
    a, b = base[:32], base[32:]
    regions, _ = cuda_graph._lent_memory(_compiled(2), [a, b], [0, 1])
    assert regions == {10: a, 11: b}


def test_non_contiguous_values_are_left_alone(lender):
    regions, _ = cuda_graph._lent_memory(_compiled(1), [torch.randn(8, 8).t()], [0])
    assert regions == {}


def test_a_forwards_saved_values_are_allocated_side_by_side():
    """`_side_by_side`: the saved values (private outputs) a capture allocates in one block, but
    not one that is another output too (a caller could hold it)."""
    import kiln
    x = kiln.symbol((8, 8), "float32", "cpu")
    user, a, b = kiln.ops.tanh(x), kiln.ops.exp(x), kiln.ops.sin(x)
    compiled = kiln.trace_from([user, a, b, b], [x]).compile()
    returned = list(range(4))
    slots = cuda_graph._side_by_side(compiled, returned, [1, 2])
    assert slots == [compiled.outputs[1]], "b's memory is the user's output too"
    assert cuda_graph._side_by_side(compiled, returned, [1]) == [compiled.outputs[1]]
    assert cuda_graph._side_by_side(compiled, returned, []) == []
