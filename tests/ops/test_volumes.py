"""3-D convolutions and pools (conv3d, conv_transpose3d, max/avg/adaptive pools) against PyTorch."""
import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.graph import OperatorError
from tests.support import assert_close, rand

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def _tol(dtype):
    return {torch.float16: 1e-2, torch.bfloat16: 5e-2}.get(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("stride, padding, dilation, groups", [(1, 0, 1, 1), (2, 1, 1, 2), (1, "same", 2, 1)])
def test_conv3d(dtype, stride, padding, dilation, groups):
    x = rand((2, 4, 5, 7, 6), dtype).transpose(3, 4)  # (2, 4, 5, 6, 7), non-contiguous
    w = rand((6, 4 // groups, 3, 2, 3), dtype)
    b = rand((6,), dtype)
    tol = _tol(dtype)
    assert_close(kiln.ops.conv3d(x, w, b, stride, padding, dilation, groups),
                 F.conv3d(x, w, b, stride, padding, dilation, groups), tol, tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_transpose3d_and_1d(dtype):
    x = rand((2, 4, 3, 5, 4), dtype)
    w = rand((4, 3, 2, 3, 2), dtype)
    tol = _tol(dtype)
    assert_close(kiln.ops.conv_transpose3d(x, w, None, 2, 1, 1),
                 F.conv_transpose3d(x, w, None, 2, 1, 1), tol, tol)
    x1, w1 = rand((3, 4, 9), dtype), rand((4, 5, 3), dtype)
    assert_close(kiln.ops.conv_transpose1d(x1, w1, None, 2, 1), F.conv_transpose1d(x1, w1, None, 2, 1), tol, tol)


@pytest.mark.parametrize("dtype", DTYPES + [torch.int32])
def test_pools3d(dtype):
    x = rand((2, 3, 6, 7, 5), dtype).transpose(2, 3)
    assert_close(kiln.ops.max_pool3d(x, 3, 2, 1), F.max_pool3d(x, 3, 2, 1))
    if dtype.is_floating_point:
        tol = _tol(dtype)
        # PyTorch's CPU avg_pool3d has no 16-bit kernels: compare with it in float32
        wide = x.float() if dtype in (torch.float16, torch.bfloat16) else x
        expected = F.avg_pool3d(wide, 2, 2, 1, False, False).to(dtype)
        assert_close(kiln.ops.avg_pool3d(x, 2, 2, 1, False, False), expected, tol, tol)
        assert_close(kiln.ops.adaptive_avg_pool3d(x, (2, 3, 1)), F.adaptive_avg_pool3d(x, (2, 3, 1)), tol, tol)
        assert_close(kiln.ops.adaptive_max_pool3d(x, 3), F.adaptive_max_pool3d(x, 3))


def test_conv3d_errors():
    with pytest.raises(OperatorError, match="conv3d: expected a 4-D \\(unbatched\\) or 5-D input"):
        kiln.ops.conv3d(rand((2, 3, 4)), rand((2, 3, 1, 1, 1)))
