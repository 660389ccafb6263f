"""Operators real models use that Kiln used to lack or decline (issue 30), through
torch.compile(backend="kiln") (and symbolic_trace graphs where dynamo rewrites the call) on the
CPU against eager: Tensor.new_tensor."""
import pytest
import torch
from torch import nn

from frontend_support import compile_and_compare, run_traced

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32]


class NewTensor(nn.Module):
    def __init__(self, data, **kwargs):
        super().__init__()
        self.data, self.kwargs = data, kwargs

    def forward(self, x):
        return x.new_tensor(self.data, **self.kwargs) * 2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("data", [[1.5, -2.25, 3.0], 7, [[1, 2, 3], [4, 5, 6]], [True, False, True], 0.1], ids=str)
def test_new_tensor_takes_self_dtype_and_device(data, dtype):
    """symbolic_trace keeps Tensor.new_tensor as a method call (dynamo rewrites it to torch.tensor)."""
    x = torch.randn(2, 3).to(dtype)
    traced = run_traced(NewTensor(data), x, atol=0, rtol=0)
    assert "new_tensor" in {n.target for n in traced.graph.nodes}


@pytest.mark.parametrize("kwargs", [dict(dtype=torch.float64), dict(dtype=torch.int32), dict(device="cpu"),
                                    dict(dtype=torch.bool)], ids=str)
def test_new_tensor_with_dtype_or_device(kwargs):
    run_traced(NewTensor([[0.5, -1.0], [2.0, 3.5]], **kwargs), torch.randn(5, 2)[::2], atol=0, rtol=0)


@pytest.mark.filterwarnings("ignore:To copy construct from a tensor")
def test_new_tensor_from_a_tensor_copies_it():
    class FromTensor(nn.Module):
        def forward(self, x, y):
            return x.new_tensor(y) + x

    run_traced(FromTensor(), torch.randn(3, 4, dtype=torch.float64), torch.randn(4, 3).t())


def test_new_tensor_through_dynamo():
    compile_and_compare(lambda x: x + x.new_tensor([1.0, 2.0, 3.0]), torch.randn(4, 3))
    compile_and_compare(lambda x: x * x.new_tensor(x.shape[0]), torch.randn(5, 3).t())
