"""Which graph inputs only index other tensors (a graph on a GPU copies those from the CPU at each
call, as PyTorch's indexing does; `kiln.frontend.torch.indices`)."""
import torch

from kiln.frontend.torch.indices import used_only_as_index


def _placeholders(fn):
    gm = torch.fx.symbolic_trace(fn)
    return {n.name: used_only_as_index(n) for n in gm.graph.nodes if n.op == "placeholder"}


def test_indices_of_reads_writes_and_index_put():
    def f(x, i, j, v):
        y = x[i] + torch.index_put(x, (j,), v)
        return y
    assert _placeholders(f) == {"x": False, "i": True, "j": True, "v": False}


def test_an_index_with_another_use_is_not_only_an_index():
    assert _placeholders(lambda x, i: x[i] + i) == {"x": False, "i": False}
    assert _placeholders(lambda x, i: x[x > 0] * 2) == {"x": False, "i": False}   # unused i


def test_a_tensor_indexed_by_itself_is_not_only_an_index():
    assert _placeholders(lambda i: i[i]) == {"i": False}
