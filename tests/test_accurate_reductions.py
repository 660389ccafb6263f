"""Long float32 reductions keep eager's accuracy: sums do not accumulate in one long sequence
(errors stay within a small multiple of eager's, measured against float64)."""
import pytest
import torch

import kiln

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _error(value, reference) -> float:
    return (value.double() - reference).abs().max().item()


def _within_eager(kiln_value, eager_value, reference, factor=4.0, floor=0.0):
    kiln_error, eager_error = _error(kiln_value, reference), _error(eager_value, reference)
    assert kiln_error <= factor * eager_error + floor, (
        f"Kiln's error {kiln_error:.3g} is more than {factor}x eager's {eager_error:.3g}")


@pytest.mark.parametrize("device", DEVICES)
def test_sum_of_two_to_the_25_ones_is_exact(device):
    x = torch.ones(2 ** 25, device=device)
    assert kiln.ops.sum(x).torch().item() == 33554432.0
    assert kiln.ops.sum(x.view(4, 2 ** 23), 1).torch().tolist() == [2.0 ** 23] * 4


@pytest.mark.parametrize("device", DEVICES)
def test_long_row_sums_are_as_accurate_as_eager(device):
    torch.manual_seed(0)
    x = (torch.randn(3, 300_001) + 3).to(device)
    _within_eager(kiln.ops.sum(x, 1).torch(), x.sum(1), x.double().sum(1), floor=1e-3)
    _within_eager(kiln.ops.mean(x, 1).torch(), x.mean(1), x.double().mean(1), floor=1e-7)


@pytest.mark.parametrize("device", DEVICES)
def test_layer_norm_over_a_long_row_near_100_is_as_accurate_as_eager(device):
    torch.manual_seed(0)
    n = 2 ** 18
    x = (100 + torch.randn(2, n)).to(device)
    got = kiln.ops.layer_norm(x, (n,)).torch()
    reference = torch.nn.functional.layer_norm(x.double(), (n,))
    _within_eager(got, torch.nn.functional.layer_norm(x, (n,)), reference, floor=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_global_average_pooling_over_4m_pixels_is_as_accurate_as_eager(device):
    torch.manual_seed(0)
    x = (torch.rand(1, 3, 2048, 2048) + 0.5).to(device)
    pool = torch.compile(lambda t: torch.nn.functional.adaptive_avg_pool2d(t, 1), backend="kiln")
    eager = torch.nn.functional.adaptive_avg_pool2d(x, 1)
    _within_eager(pool(x), eager, torch.nn.functional.adaptive_avg_pool2d(x.double(), 1), floor=1e-7)


@pytest.mark.parametrize("device", DEVICES)
def test_sums_over_leading_dims_are_as_accurate_as_eager(device):
    """Per-channel statistics of a channels-last tensor and a sum over a long batch (the CUDA
    column rule: a warp per 32 outputs, the rows split over warps and blocks)."""
    torch.manual_seed(0)
    x = (torch.randn(20001, 40) + 3).to(device)
    _within_eager(kiln.ops.sum(x, 0).torch(), x.sum(0), x.double().sum(0), floor=1e-3)
    y = (torch.randn(9, 41, 37, 48) + 10).to(device)
    _within_eager(kiln.ops.mean(y, [0, 1, 2]).torch(), y.mean([0, 1, 2]), y.double().mean([0, 1, 2]), floor=1e-6)
    _within_eager(kiln.ops.var(y, [0, 1, 2]).torch(), y.var([0, 1, 2]), y.double().var([0, 1, 2]), floor=1e-6)


def test_variance_of_values_far_from_zero_is_accurate():
    torch.manual_seed(0)
    x = 1000 + torch.randn(2, 100_000)
    _within_eager(kiln.ops.var(x, 1).torch(), x.var(1), x.double().var(1), floor=1e-6)


def test_short_and_dynamic_extent_sums_still_match():
    x = torch.randn(5, 7, 130)
    torch.testing.assert_close(kiln.ops.sum(x, (0, 2)).torch(), x.sum((0, 2)), atol=1e-5, rtol=1e-5)
    y = torch.randn(2, 3, 37, 41)
    torch.testing.assert_close(kiln.ops.adaptive_avg_pool2d(y, (3, 5)).torch(),
                               torch.nn.functional.adaptive_avg_pool2d(y, (3, 5)), atol=1e-6, rtol=1e-5)
