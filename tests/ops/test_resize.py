"""interpolate (nearest, nearest-exact, linear, bilinear, trilinear) against PyTorch."""
import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.graph import OperatorError
from tests.support import assert_close, rand

RESIZES_2D = [
    dict(size=(7, 9)),
    dict(size=(3, 2)),                                  # downsampling
    dict(size=(10, 4)),                                 # exactly 2x, and one dimension unchanged
    dict(scale_factor=(1.7, 0.6)),
    dict(scale_factor=2.5, recompute_scale_factor=True),
]


def _same(x, **kw):
    assert_close(kiln.ops.interpolate(x, **kw), F.interpolate(x, **kw))


@pytest.mark.parametrize("kw", RESIZES_2D)
def test_nearest_and_bilinear_2d(kw):
    x = rand((2, 3, 5, 4))
    _same(x, **kw)
    _same(x, **kw, mode="nearest-exact")
    _same(x, **kw, mode="bilinear")
    _same(x, **kw, mode="bilinear", align_corners=True)


@pytest.mark.parametrize("kw", [dict(size=11), dict(scale_factor=0.7), dict(scale_factor=3)])
def test_nearest_and_linear_1d(kw):
    x = rand((2, 3, 6))
    _same(x, **kw)
    _same(x, **kw, mode="linear")
    _same(x, **kw, mode="linear", align_corners=True)


@pytest.mark.parametrize("kw", [dict(size=(5, 3, 7)), dict(scale_factor=(1.5, 2, 0.7))])
def test_nearest_and_trilinear_3d(kw):
    x = rand((1, 2, 3, 4, 5))
    _same(x, **kw)
    _same(x, **kw, mode="trilinear")
    _same(x, **kw, mode="trilinear", align_corners=True)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
def test_float_dtypes(dtype):
    x = rand((1, 2, 5, 4), dtype)
    _same(x, scale_factor=(1.5, 2.25))
    _same(x, size=(7, 3), mode="bilinear")
    _same(x, size=(7, 3), mode="bilinear", align_corners=True)


def test_nearest_uint8():
    x = rand((1, 2, 5, 4), torch.uint8, high=255)
    _same(x, size=(8, 6))
    _same(x[0], scale_factor=1.6, mode="nearest-exact")


def test_non_contiguous():
    x = rand((2, 5, 4, 3)).permute(0, 3, 1, 2)
    _same(x, size=(6, 7))
    _same(x, size=(6, 7), mode="bilinear")


@pytest.mark.parametrize("call, message", [
    (lambda: kiln.ops.interpolate(rand((1, 2, 4, 4))), r"interpolate: exactly one of size and scale_factor"),
    (lambda: kiln.ops.interpolate(rand((1, 2, 4, 4)), (2, 2), 2.0), r"interpolate: exactly one of size"),
    (lambda: kiln.ops.interpolate(rand((1, 2, 4, 4)), 2, mode="bicubic"),
     r"interpolate: unsupported mode 'bicubic'"),
    (lambda: kiln.ops.interpolate(rand((1, 2, 4)), 2, mode="bilinear"),
     r"interpolate: mode 'bilinear' expects a 4-D input, got shape \(1, 2, 4\)"),
    (lambda: kiln.ops.interpolate(rand((2, 4)), 2),
     r"interpolate: mode 'nearest' expects a 3-D or 4-D or 5-D input"),
    (lambda: kiln.ops.interpolate(rand((1, 2, 4, 4)), 2, align_corners=True),
     r"interpolate: align_corners can only be set with the interpolating modes"),
    (lambda: kiln.ops.interpolate(rand((1, 2, 4, 4), torch.int64), 2, mode="bilinear"),
     r"interpolate: unsupported dtype int64"),
    (lambda: kiln.ops.interpolate(rand((1, 2, 4, 4)), (2, 3, 4)),
     r"interpolate: size must be a positive int or 2"),
    (lambda: kiln.ops.interpolate(rand((1, 2, 4, 4)), scale_factor=0.1),
     r"interpolate: scale_factor 0.1 gives an empty output"),
])
def test_bad_inputs(call, message):
    with pytest.raises(OperatorError, match=message):
        call()
