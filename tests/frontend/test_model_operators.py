"""Operators real models use that Kiln used to lack or decline (issue 30), through
torch.compile(backend="kiln") (and symbolic_trace graphs where dynamo rewrites the call) on the
CPU against eager: Tensor.new_tensor, baddbmm and addmm with a broadcast input and alpha/beta."""
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


FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
TOL = {torch.float32: 1e-4, torch.float64: 1e-7, torch.float16: 1e-2, torch.bfloat16: 5e-2}


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("input_shape", [(1, 1, 9), (3, 1, 9), (9,), (1, 9), (3, 5, 9), (3, 5, 1)], ids=str)
@pytest.mark.parametrize("beta, alpha", [(1.0, 0.125), (0.5, 1), (2, 0.3), (0.0, 0.7)], ids=str)
def test_baddbmm_broadcast_input(input_shape, beta, alpha, dtype):
    """BLOOM's alibi: torch.baddbmm(alibi, q, k, beta=beta, alpha=inv_norm_factor), alibi of shape
    (batch * heads, 1, n); k transposed (not contiguous); beta 0 ignores a NaN input, as eager does."""
    alibi = torch.randn(input_shape).to(dtype)
    if beta == 0:
        alibi[..., 0] = float("nan")
    q, k = torch.randn(3, 5, 7).to(dtype), torch.randn(3, 9, 7).to(dtype)
    compile_and_compare(lambda a, q, k: torch.baddbmm(a, q, k.transpose(1, 2), beta=beta, alpha=alpha),
                        alibi, q, k, atol=TOL[dtype], rtol=TOL[dtype])
    compile_and_compare(lambda a, q, k: a.baddbmm(q, k.transpose(1, 2), beta=beta, alpha=alpha),
                        alibi, q, k, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("input_shape", [(1, 6), (6,), (4, 6), (4, 1)], ids=str)
@pytest.mark.parametrize("beta, alpha", [(1, 1), (0.25, 3), (0, 0.5)], ids=str)
def test_addmm_broadcast_input(input_shape, beta, alpha):
    bias = torch.randn(input_shape)
    if beta == 0:
        bias[..., 0] = float("inf")
    compile_and_compare(lambda b, x, w: torch.addmm(b, x, w.t(), beta=beta, alpha=alpha),
                        bias, torch.randn(4, 11), torch.randn(6, 11))

