"""Representative operator calls of every family, with PyTorch references.

The NVRTC test renders and compiles the CUDA program of each (no GPU needed); the GPU test runs
each on CUDA against PyTorch. `make(dtype, device)` returns (args, kwargs) for both the Kiln
operator and `reference`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from tests.support import rand

FLOAT = (torch.float32, torch.float16, torch.bfloat16)


@dataclass
class Case:
    """One operator call: Kiln's `op` and PyTorch's `reference` on the same arguments."""

    name: str
    op: str
    make: Callable
    reference: Callable
    dtypes: tuple = (torch.float32,)
    tol: dict | None = None      # assert_close tolerances where the default is too tight


def _r(*shape, **kw):
    return lambda dtype, dev: rand(shape, dtype, **kw).to(dev)


def unary(shape, **kw):
    return lambda dtype, dev: ((rand(shape, dtype, **kw).to(dev),), {})


def args(*makers, **kwargs):
    return lambda dtype, dev: (tuple(m(dtype, dev) if callable(m) else m for m in makers), kwargs)


def conv2d_channels_last(x, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    """Kiln's conv2d_channels_last in PyTorch: NHWC data, (O, kH, kW, C / groups) weights."""
    out = F.conv2d(x.permute(0, 3, 1, 2), weight.permute(0, 3, 1, 2), bias, stride, padding, dilation, groups)
    return out.permute(0, 2, 3, 1)


def max_pool_backward_args(dtype, dev):
    """The gradient of a 3 x 3, stride 2 max pool: overlapping windows, indices from torch."""
    x = rand((2, 3, 11, 10), dtype).to(dev)
    values, indices = F.max_pool2d(x, 3, 2, 1, return_indices=True)
    return (rand(values.shape, dtype).to(dev), x, [3, 3], [2, 2], [1, 1], [1, 1], False, indices), {}


def max_pool_offsets_backward_args(dtype, dev):
    """The gradient of a 3 x 3, stride 2 max pool through int8 offsets within the windows."""
    x = rand((2, 3, 11, 10), dtype).to(dev)
    pool = ([3, 3], [2, 2], [1, 1], [1, 1], False)
    values, offsets = torch.ops.kiln.max_pool2d_with_offsets(x, *pool)
    return (rand(values.shape, dtype).to(dev), offsets, list(x.shape), *pool), {}


CASES = [
    Case("relu", "relu", unary((33, 65)), torch.relu, FLOAT),
    Case("gelu_tanh", "gelu", args(_r(7, 300), approximate="tanh"), F.gelu, FLOAT),
    Case("sigmoid", "sigmoid", unary((1000,)), torch.sigmoid, FLOAT + (torch.float64,)),
    Case("exp", "exp", unary((5, 7, 9)), torch.exp, FLOAT),
    Case("add_broadcast", "add", args(_r(4, 1, 6), _r(5, 6)), torch.add, FLOAT + (torch.int32, torch.int64)),
    Case("mul_scalar", "mul", args(_r(17, 3), 2.5), torch.mul, FLOAT),
    Case("div_floor", "div", args(_r(64, 3), _r(64, 3, nonzero=True), rounding_mode="floor"), torch.div,
         (torch.float32, torch.int32)),
    Case("where", "where", lambda dt, dev: ((rand((8, 9), torch.bool).to(dev), rand((8, 9), dt).to(dev),
                                            rand((9,), dt).to(dev)), {}), torch.where, FLOAT),
    Case("clamp", "clamp", args(_r(100), min=-1.0, max=0.5), torch.clamp),
    Case("cast", "cast", args(_r(30, 3), torch.float16), lambda x, d: x.to(d)),
    Case("sum_dim", "sum", args(_r(37, 129), dim=1), torch.sum, FLOAT),
    Case("sum_all_large", "sum", args(_r(300, 1000)), torch.sum, tol={"atol": 1e-3, "rtol": 1e-4}),
    Case("mean_keepdim", "mean", args(_r(6, 50, 7), dim=1, keepdim=True), torch.mean, FLOAT),
    Case("amax_long_row", "amax", args(_r(3, 5000), dim=-1), torch.amax, FLOAT),
    Case("argmax", "argmax", args(_r(33, 70), dim=1), torch.argmax, (torch.float32, torch.int64)),
    Case("argmin_row_block", "argmin", args(_r(2, 3000), dim=1), torch.argmin),
    Case("var", "var", args(_r(16, 200), dim=1), torch.var),
    Case("prod", "prod", args(_r(40, 6, low=0.5, high=1.5), dim=1), torch.prod),
    Case("any", "any", lambda dt, dev: ((rand((9, 40), torch.bool).to(dev),), {"dim": 1}), torch.any),
    Case("cumsum", "cumsum", args(_r(5, 100), 1), torch.cumsum),
    Case("softmax", "softmax", args(_r(64, 768), -1), torch.softmax, FLOAT),
    Case("softmax_long", "softmax", args(_r(4, 4096), -1), torch.softmax),
    Case("log_softmax", "log_softmax", args(_r(10, 33), 0), torch.log_softmax),
    Case("layer_norm", "layer_norm", lambda dt, dev: ((rand((64, 768), dt).to(dev), (768,),
                                                       rand((768,), dt).to(dev), rand((768,), dt).to(dev)), {}),
         F.layer_norm, FLOAT),
    Case("rms_norm", "rms_norm", args(_r(8, 64), (64,), eps=1e-6), F.rms_norm),
    Case("group_norm", "group_norm", args(_r(2, 8, 5, 5), 4), F.group_norm),
    Case("permute", "permute", args(_r(3, 4, 5), (2, 0, 1)), torch.permute, (torch.float32, torch.int64)),
    Case("transpose", "transpose", args(_r(30, 70), 0, 1), torch.transpose, (torch.float16,)),
    Case("cat", "cat", lambda dt, dev: (([rand((2, 3), dt).to(dev), rand((4, 3), dt).to(dev)],), {}), torch.cat),
    Case("pad_reflect", "pad", args(_r(2, 3, 8), (2, 3), mode="reflect"), F.pad),
    Case("flip", "flip", args(_r(4, 6), (0, 1)), torch.flip),
    Case("roll", "roll", args(_r(4, 6), 2, 1), torch.roll),
    Case("gather", "gather", lambda dt, dev: ((rand((5, 8), dt).to(dev), 1,
                                              torch.randint(0, 8, (5, 3)).to(dev)), {}), torch.gather),
    Case("embedding", "embedding", lambda dt, dev: ((torch.randint(0, 50, (4, 7)).to(dev),
                                                    rand((50, 16), dt).to(dev)), {}), F.embedding, FLOAT),
    Case("embedding_backward", "embedding_backward",
         lambda dt, dev: ((rand((40, 24), dt).to(dev), torch.randint(0, 9, (40,)).to(dev), 11), {"padding_idx": 3}),
         lambda g, i, n, padding_idx: torch.ops.aten.embedding_dense_backward(g, i, n, padding_idx, False),
         FLOAT + (torch.float64,)),
    Case("tril", "tril", args(_r(6, 6)), torch.tril),
    Case("matmul", "matmul", args(_r(33, 70), _r(70, 45)), torch.matmul, FLOAT),
    Case("matmul_tile_edges", "matmul", args(_r(130, 72), _r(72, 136)), torch.matmul, FLOAT),
    Case("matmul_batched", "matmul", args(_r(2, 3, 16, 24), _r(24, 40)), torch.matmul, FLOAT),
    Case("linear", "linear", args(_r(5, 7, 32), _r(20, 32), _r(20)), F.linear, FLOAT),
    Case("conv2d", "conv2d", args(_r(2, 3, 9, 9), _r(8, 3, 3, 3), _r(8), stride=2, padding=1), F.conv2d, FLOAT),
    Case("conv2d_depthwise", "conv2d", args(_r(1, 6, 8, 8), _r(6, 1, 3, 3), None, 1, 1, 1, 6), F.conv2d),
    Case("conv2d_channels_last_depthwise", "conv2d_channels_last",
         args(_r(2, 7, 9, 24), _r(24, 5, 5, 1), _r(24), stride=2, padding=2, groups=24), conv2d_channels_last,
         (torch.float16,), tol={"atol": 1e-2, "rtol": 1e-2}),
    Case("conv1d", "conv1d", args(_r(2, 4, 20), _r(5, 4, 3)), F.conv1d),
    Case("max_pool2d", "max_pool2d", args(_r(2, 3, 10, 10), 3, 2, 1), F.max_pool2d, FLOAT),
    # long sums in another order than torch's: float32 within 1e-4 of the sum's scale here;
    # tests/test_accurate_reductions.py holds them to eager's own error against float64
    Case("mean_over_leading_dims", "mean", args(_r(5, 31, 29, 48), [0, 1, 2], True), torch.mean, FLOAT,
         {"atol": 1e-4, "rtol": 1.6e-2}),
    Case("sum_over_batch", "sum", args(_r(6001, 33), 0), torch.sum, FLOAT, {"atol": 2e-2, "rtol": 1.6e-2}),
    Case("amax_over_batch", "amax", args(_r(4100, 3, 40), [0, 1]), torch.amax, FLOAT),
    Case("max_pool2d_with_indices", "max_pool2d_with_indices", args(_r(2, 3, 11, 10), 3, 2, 1),
         lambda *a: F.max_pool2d(*a, return_indices=True), FLOAT),
    Case("max_pool2d_with_indices_backward", "max_pool2d_with_indices_backward", max_pool_backward_args,
         torch.ops.aten.max_pool2d_with_indices_backward, FLOAT),
    Case("max_pool2d_with_offsets", "max_pool2d_with_offsets",
         args(_r(2, 3, 11, 10), [3, 3], [2, 2], [1, 1], [1, 1], False),
         lambda *a: torch.ops.kiln.max_pool2d_with_offsets(*a), FLOAT),
    Case("max_pool2d_offsets_backward", "max_pool2d_offsets_backward", max_pool_offsets_backward_args,
         lambda *a: torch.ops.kiln.max_pool2d_offsets_backward(*a), FLOAT),
    Case("avg_pool2d", "avg_pool2d", args(_r(2, 3, 10, 10), 2), F.avg_pool2d),
    Case("adaptive_avg_pool2d", "adaptive_avg_pool2d", args(_r(2, 3, 10, 7), (3, 4)), F.adaptive_avg_pool2d),
    Case("interpolate_bilinear", "interpolate", args(_r(1, 2, 5, 6), scale_factor=2, mode="bilinear",
                                                     align_corners=False), F.interpolate),
    Case("arange", "arange", lambda dt, dev: ((0, 100, 3), {"device": dev}), torch.arange),
]
