"""matmul and linear against PyTorch."""
import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.graph import OperatorError
from tests.support import assert_close, rand

DTYPES = [torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8]


@pytest.mark.parametrize("xs, ys", [
    ((5,), (5,)),                    # dot product
    ((3, 5), (5,)),                  # matrix-vector
    ((5,), (5, 4)),                  # vector-matrix
    ((5,), (2, 5, 3)),               # vector-batched matrix
    ((2, 3, 5), (5,)),               # batched matrix-vector
    ((3, 5), (5, 4)),                # matrix-matrix
    ((2, 1, 3, 4), (5, 4, 2)),       # batch dims broadcast both ways
    ((3, 4), (2, 4, 5)),             # matrix broadcast against a batch
])
def test_matmul_shapes(xs, ys):
    x, y = rand(xs), rand(ys)
    assert_close(kiln.ops.matmul(x, y), torch.matmul(x, y))


@pytest.mark.parametrize("dtype", DTYPES)
def test_matmul_dtypes(dtype):
    # 16-bit floats accumulate in float32 and round once, as PyTorch does: default tolerances hold.
    x, y = rand((2, 3, 6), dtype), rand((6, 4), dtype)
    assert_close(kiln.ops.matmul(x, y), torch.matmul(x, y))


def test_matmul_non_contiguous():
    x = rand((2, 6, 3)).transpose(1, 2)
    y = rand((4, 12))[:, ::2].t()
    assert_close(kiln.ops.matmul(x, y), torch.matmul(x, y))


def test_matmul_through_the_tensor_operator():
    x, y = rand((3, 5)), rand((5, 2))
    assert_close(kiln.from_torch(x) @ kiln.from_torch(y), x @ y)


@pytest.mark.parametrize("xs, bias", [((5,), False), ((2, 3, 5), True), ((4, 5), True)])
def test_linear(xs, bias):
    x, w = rand(xs), rand((3, 5))
    b = rand((3,)) if bias else None
    assert_close(kiln.ops.linear(x, w, b), F.linear(x, w, b))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16, torch.int64])
def test_linear_dtypes(dtype):
    x, w, b = rand((4, 6), dtype), rand((3, 6), dtype), rand((3,), dtype)
    assert_close(kiln.ops.linear(x, w, b), F.linear(x, w, b))


def test_linear_non_contiguous():
    x, w, b = rand((6, 4)).t(), rand((6, 3)).t(), rand((6,))[::2]
    assert_close(kiln.ops.linear(x, w, b), F.linear(x, w, b))


@pytest.mark.parametrize("call, message", [
    (lambda: kiln.ops.matmul(rand((3, 4)), rand((5, 2))),
     r"matmul: cannot multiply .*inner dimensions 4 and 5"),
    (lambda: kiln.ops.matmul(rand((2, 3, 4)), rand((3, 4, 2))),
     r"matmul: shapes \(2,\) and \(3,\) cannot be broadcast"),
    (lambda: kiln.ops.matmul(rand((3, 4)), rand((4,), torch.float64)), r"matmul: expected inputs of one dtype"),
    (lambda: kiln.ops.matmul(rand(()), rand((4,))), r"matmul: input 'x' is 0-dimensional"),
    (lambda: kiln.ops.matmul(rand((3, 4), torch.bool), rand((4,), torch.bool)),
     r"matmul: unsupported dtype bool"),
    (lambda: kiln.ops.linear(rand((3, 4)), rand((2, 3, 4))), r"linear: weight must be 2-D"),
    (lambda: kiln.ops.linear(rand((3, 4)), rand((2, 5))),
     r"linear: input of shape \(3, 4\) does not end with in_features = 5"),
    (lambda: kiln.ops.linear(rand((3, 4)), rand((2, 4)), rand((3,))),
     r"linear: bias of shape \(3,\) does not match"),
])
def test_bad_inputs(call, message):
    with pytest.raises(OperatorError, match=message):
        call()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("xs, basis", [((7, 5), (5, 9)), ((2, 3, 5), (5, 4)), ((1, 33), (33, 34))])
def test_dft_is_a_product_with_its_basis(xs, basis, dtype):
    """dft (kiln-mappings-builtin's FFTs multiply by a basis matrix): x @ basis in x's dtype."""
    x, b = rand(xs, dtype), rand(basis, dtype)
    assert_close(kiln.ops.dft(x, b), x @ b)
    assert_close(kiln.ops.dft(x.transpose(0, -1).contiguous().transpose(0, -1), b[:, :]), x @ b)


def test_dft_errors_and_traits():
    assert not kiln.ops.dft.traits.tf32     # never rounded to TF32, whatever torch allows matmuls
    with pytest.raises(OperatorError, match=r"dft: expected x \(..., K\) and a basis \(K, N\)"):
        kiln.ops.dft(rand((2, 5)), rand((4, 3)))
    with pytest.raises(OperatorError, match="dft: expected inputs of one dtype"):
        kiln.ops.dft(rand((2, 5)), rand((5, 3), torch.float64))
