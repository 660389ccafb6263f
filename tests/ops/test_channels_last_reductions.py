"""Batch-norm statistics of channels-last data on the CPU against PyTorch in float64: sums,
means and variances over N, H and W of the NCHW view of NHWC memory (as a channels-last
training graph reads them), and of NCHW memory, at odd row and channel counts, and of no channels.
Run with KILN_NVRTC_CHECK=sm_80,sm_90, every task built here also compiles its CUDA program
(column, moments and split kernels) with NVRTC."""
import pytest
import torch

import kiln
from support import assert_close, rand

ops = kiln.ops
NCHW = [0, 3, 1, 2]         # permute dims taking NHWC memory to its logical NCHW view

# (N, H, W): N * H * W rows of 1, 7, 1000 and 25088 (a quarter of ResNet-50's 100352)
ROWS = [(1, 1, 1), (1, 7, 1), (2, 20, 25), (2, 112, 112)]
CHANNELS = [1, 3, 64, 257]


def _statistics(s):
    """The graph's outputs from the NHWC symbol `s`: sum, mean and (biased, unbiased) variance
    over the NCHW view's N, H and W."""
    view = ops.permute(s, NCHW)
    return [ops.sum(view, [0, 2, 3]), ops.mean(view, [0, 2, 3], True),
            ops.var(view, [0, 2, 3], 0, True), ops.var(view, [0, 2, 3], 1, False)]


def _expected(x: torch.Tensor, dtype) -> list[torch.Tensor]:
    ref = x.double().permute(*NCHW)
    return [t.to(dtype) for t in (ref.sum((0, 2, 3)), ref.mean((0, 2, 3), keepdim=True),
                                  ref.var((0, 2, 3), correction=0, keepdim=True),
                                  ref.var((0, 2, 3), correction=1))]


def _run(make, x: torch.Tensor):
    s = kiln.symbol(list(x.shape), str(x.dtype).replace("torch.", ""))
    return kiln.graph.optimize(kiln.trace_from(make(s), [s])).run([x])


def _check(got, expected, rows: int, dtype) -> None:
    for g, e in zip(got, expected):
        # a float32 sum of `rows` values rounds by about sqrt(rows) of its values' ulps
        scale = e.double().nan_to_num().abs().max().item() if e.numel() else 1.0
        atol = 1e-5 * max(1.0, rows ** 0.5) * max(scale, 1.0) if dtype == torch.float32 else None
        assert_close(g, e, atol=atol, rtol=1e-5 if dtype == torch.float32 else None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("channels", CHANNELS)
@pytest.mark.parametrize("nhw", ROWS, ids=lambda s: "x".join(map(str, s)))
def test_statistics_of_channels_last_memory_match_torch(nhw, channels, dtype):
    if nhw == ROWS[-1] and channels == 257:
        pytest.skip("25088 x 257: the 64-channel case covers the long columns, faster")
    n, h, w = nhw
    x = rand((n, h, w, channels), dtype)
    _check(_run(_statistics, x), _expected(x, dtype), n * h * w, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_variance_of_values_far_from_zero(dtype):
    """1000 + noise: a difference of sums of squares would lose the variance."""
    x = (torch.randn(2, 20, 25, 64) + 1000).to(dtype)
    _check(_run(_statistics, x), _expected(x, dtype), 1000, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(3, 257, 7, 9), (2, 64, 40, 50)])
def test_sums_over_nchw_memory_match_torch(shape, dtype):
    x = rand(shape, dtype)
    got = _run(lambda s: [ops.sum(s, [0, 2, 3]), ops.var(s, [0, 2, 3], 0, True)], x)
    ref = x.double()
    rows = shape[0] * shape[2] * shape[3]
    _check(got, [ref.sum((0, 2, 3)).to(dtype), ref.var((0, 2, 3), correction=0, keepdim=True).to(dtype)], rows, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_statistics_of_no_channels_are_empty(dtype):
    x = torch.empty((2, 3, 4, 0), dtype=dtype)
    _check(_run(_statistics, x), _expected(x, dtype), 24, dtype)


@pytest.mark.parametrize("shape", [(0, 5, 6, 64), (2, 0, 3, 40)])
def test_statistics_over_no_rows_are_refused_plainly(shape):
    """Kiln's reductions do not take an empty reduction (PyTorch's sum gives 0, its mean NaN):
    the operator says so, naming the dimension, rather than computing anything."""
    with pytest.raises(kiln.graph.OperatorError, match="empty reductions are not supported"):
        _run(_statistics, torch.empty(shape))
