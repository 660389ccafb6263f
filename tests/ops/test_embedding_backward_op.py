"""The embedding_backward operator (an embedding table's gradient, aten.embedding_dense_backward
without scale_grad_by_freq) on the CPU against a float64 reference: every row the float32 sum
(float64 for float64 grads) of its tokens' rows, rounded once to the grad's dtype; the padding
row zero; indices out of range fail."""
import pytest
import torch

import kiln
from kiln.graph import OperatorError
from support import rand

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def reference(grad, indices, rows, padding_idx=-1):
    """The exact sums (float64), the padding row zero."""
    out = torch.zeros(rows, grad.shape[1], dtype=torch.float64).index_add_(0, indices.long(), grad.double())
    if 0 <= padding_idx < rows:
        out[padding_idx] = 0
    return out


def assert_rounded_once(got, exact, dtype):
    """`got` is `exact` rounded to `dtype` (within half a unit in the last place of `dtype`, and
    float32's accumulation error)."""
    assert got.dtype == dtype
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(got.double(), exact, rtol=eps / 2 + 1e-6 * (dtype != torch.float64), atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("tokens,rows,width,high,padding_idx", [
    (23, 11, 7, 5, -1),          # repeated indices, rows no token reaches
    (17, 9, 5, 1, -1),           # every token on row 0
    (1, 4, 3, 4, -1),            # a single token
    (40, 13, 9, 13, 6),          # a padding row
    (33, 101, 1, 7, 0),          # one column, padding row 0
])
def test_embedding_backward(dtype, index_dtype, tokens, rows, width, high, padding_idx):
    grad = rand((tokens, width), dtype)
    indices = torch.randint(0, high, (tokens,), dtype=index_dtype)
    if padding_idx >= 0:
        indices[::3] = padding_idx
    got = kiln.ops.embedding_backward(grad, indices, rows, padding_idx=padding_idx).torch()
    assert_rounded_once(got, reference(grad, indices, rows, padding_idx), dtype)
    if padding_idx >= 0:
        assert not got[padding_idx].any()


def test_16_bit_sums_are_rounded_once():
    """Sixty-four tokens on one row: a sum in bfloat16 would round at every step (PyTorch's CPU
    kernel does, and is off by more than half a unit); this one is within half a unit."""
    torch.manual_seed(0)
    grad = rand((64, 16), torch.bfloat16)
    indices = torch.zeros(64, dtype=torch.int64)
    exact = reference(grad, indices, 2)
    got = kiln.ops.embedding_backward(grad, indices, 2).torch()
    assert_rounded_once(got, exact, torch.bfloat16)
    assert torch.equal(got, exact.float().bfloat16())


@pytest.mark.parametrize("bad", [-1, 5, 1 << 40])
def test_an_index_out_of_range_fails(bad):
    indices = torch.tensor([0, bad, 2])
    with pytest.raises(IndexError, match="out of range for a weight of 5 rows"):
        kiln.ops.embedding_backward(torch.randn(3, 4), indices, 5).torch()


def test_arguments_are_checked():
    with pytest.raises(OperatorError, match="expected grad"):
        kiln.ops.embedding_backward(torch.randn(3, 4), torch.zeros(2, dtype=torch.int64), 5)
    with pytest.raises(OperatorError, match="expected grad"):
        kiln.ops.embedding_backward(torch.randn(1, 3, 4), torch.zeros(1, 3, dtype=torch.int64), 5)
    with pytest.raises(OperatorError, match="floating-point"):
        kiln.ops.embedding_backward(torch.ones(3, 4, dtype=torch.int64), torch.zeros(3, dtype=torch.int64), 5)
    with pytest.raises(OperatorError, match="int64 or int32"):
        kiln.ops.embedding_backward(torch.randn(3, 4), torch.zeros(3), 5)
