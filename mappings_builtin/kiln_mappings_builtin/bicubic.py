"""Bicubic interpolation as two matrix products: out = A_h @ x @ A_w^T, the interpolation
matrices built at trace time by PyTorch itself (interpolating one-hot rows), so sizes, scales,
align_corners and the border handling are exactly PyTorch's."""
import torch
import torch.nn.functional as F

from kiln import ops
from kiln.frontend.torch import register_function
from kiln.tensor import asarray


def _bicubic(input, size=None, scale_factor=None, mode="nearest", align_corners=None,
             recompute_scale_factor=None, antialias=False) -> bool:
    return mode == "bicubic" and not antialias and input.ndim == 4


def _matrix(n: int, axis: int, size, scale_factor, align_corners, recompute_scale_factor) -> torch.Tensor:
    """(n_out, n) matrix interpolating one spatial axis (0: height, 1: width) of size n."""
    basis = torch.eye(n, dtype=torch.float64).reshape(n, 1, n, 1) if axis == 0 else \
        torch.eye(n, dtype=torch.float64).reshape(n, 1, 1, n)
    sizes = None if size is None else ((size[0], 1) if axis == 0 else (1, size[1]))
    scales = None if scale_factor is None else ((scale_factor[0], 1.0) if axis == 0 else (1.0, scale_factor[1]))
    out = F.interpolate(basis, sizes, scales, "bicubic", align_corners, recompute_scale_factor)
    return out.reshape(n, -1).t().contiguous()


@register_function(F.interpolate, priority=1, check=_bicubic)
def interpolate_bicubic(input, size=None, scale_factor=None, mode="nearest", align_corners=None,
                        recompute_scale_factor=None, antialias=False):
    size = None if size is None else ((size, size) if isinstance(size, int) else tuple(size))
    if scale_factor is not None and not isinstance(scale_factor, (tuple, list)):
        scale_factor = (scale_factor, scale_factor)
    h, w = input.shape[2:]
    a_h = _matrix(h, 0, size, scale_factor, align_corners, recompute_scale_factor)
    a_w = _matrix(w, 1, size, scale_factor, align_corners, recompute_scale_factor)
    dtype = input.dtype.torch_dtype
    a_h, a_w = (asarray(a.to(dtype), device=input.device) for a in (a_h, a_w))
    rows = ops.matmul(a_h, input)                         # (N, C, H_out, W)
    return ops.matmul(rows, ops.transpose(a_w, 0, 1))     # (N, C, H_out, W_out)
