"""Max, average and adaptive pooling (1-D and 2-D) against PyTorch."""
import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.graph import OperatorError
from tests.support import assert_close, rand

WINDOWS_2D = [
    dict(kernel_size=2),
    dict(kernel_size=3, stride=2, padding=1, ceil_mode=True),
    dict(kernel_size=(2, 3), stride=(3, 2), ceil_mode=True),      # last windows hang over the edge
    dict(kernel_size=(3, 2), stride=(2, 1), padding=(1, 1)),
]
WINDOWS_1D = [dict(kernel_size=3), dict(kernel_size=4, stride=3, padding=2, ceil_mode=True)]


def _same(name, x, *args, **kw):
    assert_close(getattr(kiln.ops, name)(x, *args, **kw), getattr(F, name)(x, *args, **kw))


@pytest.mark.parametrize("kw", WINDOWS_2D)
def test_max_avg_pool2d(kw):
    x = rand((2, 3, 7, 6))
    _same("max_pool2d", x, **kw)
    _same("avg_pool2d", x, **kw)
    _same("avg_pool2d", x, **kw, count_include_pad=False)


@pytest.mark.parametrize("kw", WINDOWS_1D)
def test_max_avg_pool1d(kw):
    x = rand((2, 3, 9))
    _same("max_pool1d", x, **kw)
    _same("avg_pool1d", x, **kw)
    _same("avg_pool1d", x, **kw, count_include_pad=False)


def test_max_pool_dilation_and_unbatched():
    _same("max_pool2d", rand((3, 8, 7)), (3, 2), (2, 1), (1, 1), (2, 3), True)
    _same("max_pool1d", rand((3, 10)), 3, 2, 1, 2)


def test_avg_pool2d_divisor_override():
    _same("avg_pool2d", rand((2, 7, 6)), 3, 2, 1, True, True, 5)


def test_max_pool_propagates_nan():
    x = rand((1, 2, 6, 6))
    x[0, 1, 2, 3] = float("nan")
    _same("max_pool2d", x, 3, 2, 1)
    _same("adaptive_max_pool2d", x, (2, 4))


@pytest.mark.parametrize("size", [3, (4, 5), (None, 2), (7, 6), (10, 9)])
def test_adaptive_pool2d(size):
    x = rand((2, 3, 7, 6))
    _same("adaptive_avg_pool2d", x, size)
    _same("adaptive_max_pool2d", x, size)


@pytest.mark.parametrize("size", [4, 9, 13])
def test_adaptive_pool1d(size):
    x = rand((3, 9))
    _same("adaptive_avg_pool1d", x, size)
    _same("adaptive_max_pool1d", x, size)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
def test_float_dtypes(dtype):
    # Averages of 16-bit inputs accumulate in float32 and round once, as PyTorch's CPU kernels do.
    x = rand((2, 3, 7, 6), dtype)
    for name in ("max_pool2d", "avg_pool2d"):
        _same(name, x, 3, 2, 1, ceil_mode=True)
        _same(name.replace("2d", "1d"), x[0], 3, 2, 1)
    for name in ("adaptive_avg_pool2d", "adaptive_max_pool2d"):
        _same(name, x, (3, 4))
        _same(name.replace("2d", "1d"), x[0], 4)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8])
def test_max_pool_integers(dtype):
    x = rand((2, 3, 7, 6), dtype, low=-100, high=100)
    _same("max_pool2d", x, 3, 2, 1)
    # PyTorch's max_pool1d has no integer kernel: a 1-row max_pool2d is the reference
    expected = F.max_pool2d(x[0].unsqueeze(-2), (1, 2), (1, 2), (0, 1)).squeeze(-2)
    assert_close(kiln.ops.max_pool1d(x[0], 2, 2, 1), expected)


def test_non_contiguous():
    x = rand((2, 7, 6, 3)).permute(0, 3, 1, 2)
    _same("max_pool2d", x, 3, 2, 1)
    _same("avg_pool2d", x, 2)
    _same("adaptive_avg_pool2d", x, (4, 3))
    _same("adaptive_max_pool1d", x[0, :, 1], 4)


@pytest.mark.parametrize("call, message", [
    (lambda: kiln.ops.max_pool2d(rand((1, 3, 6, 6)), 3, 1, 2),
     r"max_pool2d: padding \(2, 2\) must be at most half of the kernel size \(3, 3\)"),
    (lambda: kiln.ops.max_pool2d(rand((1, 3, 2, 6)), 3),
     r"max_pool2d: input of shape \(1, 3, 2, 6\) is too small for kernel_size \(3, 3\)"),
    (lambda: kiln.ops.max_pool2d(rand((6, 6)), 2), r"max_pool2d: expected a 3-D \(unbatched\) or 4-D input"),
    (lambda: kiln.ops.max_pool1d(rand((1, 3, 6)), (2, 2)),
     r"max_pool1d: 'kernel_size' must be an int or 1 ints"),
    (lambda: kiln.ops.max_pool2d(rand((1, 3, 6, 6)), 2, 0), r"max_pool2d: kernel_size .* must be positive"),
    (lambda: kiln.ops.max_pool2d(rand((1, 3, 6, 6), torch.bool), 2), r"max_pool2d: unsupported dtype bool"),
    (lambda: kiln.ops.avg_pool2d(rand((1, 3, 6, 6), torch.int64), 2), r"avg_pool2d: unsupported dtype int64"),
    (lambda: kiln.ops.avg_pool2d(rand((1, 3, 6, 6)), 2, divisor_override=0),
     r"avg_pool2d: divisor_override must be a non-zero int"),
    (lambda: kiln.ops.adaptive_avg_pool2d(rand((1, 3, 6, 6)), (2, 0)),
     r"adaptive_avg_pool2d: output_size must be a positive int or 2"),
    (lambda: kiln.ops.adaptive_max_pool1d(rand((1, 3, 6)), (2, 2)),
     r"adaptive_max_pool1d: output_size must be a positive int or 1"),
    (lambda: kiln.ops.adaptive_max_pool2d(rand((1, 3, 6, 6), torch.int32), 2),
     r"adaptive_max_pool2d: unsupported dtype int32"),
])
def test_bad_inputs(call, message):
    with pytest.raises(OperatorError, match=message):
        call()


@pytest.mark.parametrize("nd, shape, kw", [
    (2, (2, 3, 9, 11), dict(kernel_size=3, stride=2, padding=1)),
    (2, (3, 8, 7), dict(kernel_size=(3, 2), stride=(2, 1), padding=(1, 1), dilation=(2, 3), ceil_mode=True)),
    (1, (2, 3, 10), dict(kernel_size=4, stride=3, padding=2, ceil_mode=True)),
    (3, (1, 2, 5, 6, 7), dict(kernel_size=(2, 3, 2), stride=(1, 2, 2), padding=(1, 1, 0))),
])
def test_max_pool_with_indices_and_its_backward(nd, shape, kw):
    """Positions as torch gives them (ties: the first; a window of -inf only: its first element
    inside the input), and the gradient through them."""
    x = rand(shape)
    x[..., :3] = x[..., :3].round()        # ties within windows
    x[..., 0, :2] = float("-inf")          # windows over the padding holding only -inf
    values, indices = getattr(F, f"max_pool{nd}d")(x, **kw, return_indices=True)
    assert_close(getattr(kiln.ops, f"max_pool{nd}d_with_indices")(x, **kw), (values, indices))
    if nd == 1:
        return
    grad = rand(values.shape)
    args = (kw["kernel_size"], kw.get("stride", []), kw.get("padding", 0), kw.get("dilation", 1),
            kw.get("ceil_mode", False))
    expected = getattr(torch.ops.aten, f"max_pool{nd}d_with_indices_backward")(grad, x, *args, indices)
    actual = getattr(kiln.ops, f"max_pool{nd}d_with_indices_backward")(grad, x, *args, indices)
    assert_close(actual, expected)


def test_max_pool_backward_sums_overlapping_windows_in_float32():
    """A position that wins many overlapping windows sums all their gradients (in float32 for
    16-bit gradients)."""
    x = rand((1, 1, 12, 12), torch.bfloat16)
    x[0, 0, 5, 5] = 100.0
    values, indices = F.max_pool2d(x, 5, 1, 2, return_indices=True)
    grad = rand(values.shape, torch.bfloat16)
    actual = kiln.ops.max_pool2d_with_indices_backward(grad, x, [5, 5], [1, 1], [2, 2], [1, 1], False,
                                                       indices).torch()
    expected = torch.ops.aten.max_pool2d_with_indices_backward(
        grad.float(), x.float(), [5, 5], [1, 1], [2, 2], [1, 1], False, indices).bfloat16()
    assert_close(actual, expected)


def test_max_pool_with_indices_through_torch_compile():
    x = rand((2, 3, 9, 8))

    def pools(x):
        a, i = F.max_pool2d(x, 3, 2, 1, return_indices=True)
        b, j = F.max_pool2d_with_indices(x, 2)
        return a, i, b, j

    for actual, expected in zip(torch.compile(pools, backend="kiln")(x), pools(x)):
        assert torch.equal(actual, expected)


@pytest.mark.parametrize("nd, shape, kw", [
    (2, (2, 3, 11, 10), dict(kernel_size=3, stride=2, padding=1)),
    (2, (1, 2, 9, 12), dict(kernel_size=(2, 3), stride=(1, 2), padding=(1, 0), dilation=(2, 1), ceil_mode=True)),
    (1, (2, 3, 10), dict(kernel_size=4, stride=3, padding=2, ceil_mode=True)),
    (3, (1, 2, 5, 6, 7), dict(kernel_size=(2, 3, 2), stride=(1, 2, 2), padding=(1, 1, 0))),
])
def test_max_pool_with_offsets_and_its_backward(nd, shape, kw):
    """The int8 offsets name, within each window, the positions max_pool_with_indices gives, and
    the gradient through them, from the input's size alone, is the one through the positions."""
    x = rand(shape)
    x[..., :3] = x[..., :3].round()        # ties within windows
    x[..., 0, :2] = float("-inf")          # windows over the padding holding only -inf
    args = (kw["kernel_size"], kw.get("stride", []), kw.get("padding", 0), kw.get("dilation", 1),
            kw.get("ceil_mode", False))
    values, indices = [t.torch() for t in getattr(kiln.ops, f"max_pool{nd}d_with_indices")(x, *args)]
    got_values, offsets = [t.torch() for t in getattr(kiln.ops, f"max_pool{nd}d_with_offsets")(x, *args)]
    assert torch.equal(got_values, values) and offsets.dtype == torch.int8
    grad = rand(values.shape)
    expected = getattr(kiln.ops, f"max_pool{nd}d_with_indices_backward")(grad, x, *args, indices).torch()
    actual = getattr(kiln.ops, f"max_pool{nd}d_offsets_backward")(grad, offsets, list(x.shape), *args).torch()
    assert torch.equal(actual, expected)
