"""random_uniform: a counter-based generator keyed by a row of int64 seeds."""
import pytest
import torch

from kiln import ops
from kiln.graph import OperatorError
from kiln.tensor import from_torch


def _seeds(*rows):
    return from_torch(torch.tensor(rows, dtype=torch.int64))


def test_uniform_on_unit_interval():
    u = ops.random_uniform(_seeds([123456789, 4000000000]), 0, (203, 511)).torch()
    assert u.dtype == torch.float32 and u.shape == (203, 511)
    assert u.min() >= 0 and u.max() < 1
    counts = torch.histc(u, 20, 0, 1)
    expected = u.numel() / 20
    chi_square = ((counts - expected) ** 2 / expected).sum().item()
    assert chi_square < 45, f"chi-square {chi_square} with 19 degrees of freedom"
    assert abs(u.mean().item() - 0.5) < 0.005 and abs(u.var().item() - 1 / 12) < 0.002
    flat = u.flatten()
    lag = torch.corrcoef(torch.stack([flat[:-1], flat[1:]]))[0, 1].item()
    assert abs(lag) < 0.01


def test_same_key_same_numbers_other_key_other_numbers():
    seeds = _seeds([1, 2], [1, 3], [2, 2])
    first = ops.random_uniform(seeds, 0, (256, 257)).torch()
    assert torch.equal(first, ops.random_uniform(seeds, 0, (256, 257)).torch())
    for row in (1, 2):
        other = ops.random_uniform(seeds, row, (256, 257)).torch()
        assert (other == first).float().mean() < 0.01
        assert abs(torch.corrcoef(torch.stack([first.flatten(), other.flatten()]))[0, 1]) < 0.02
    # the numbers depend on the flat position only: a prefix of a longer draw
    longer = ops.random_uniform(seeds, 0, (256 * 257 + 7,)).torch()
    assert torch.equal(longer[:256 * 257], first.flatten())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_narrow_types_never_reach_one(dtype):
    u = ops.random_uniform(_seeds([7, 9]), 0, (4096,), dtype).torch()
    assert u.dtype == dtype and u.min() >= 0 and u.max() < 1
    assert abs(u.float().mean().item() - 0.5) < 0.03


def test_errors_name_the_problem():
    with pytest.raises(OperatorError, match="shape \\(n, 2\\)"):
        ops.random_uniform(from_torch(torch.zeros(3, dtype=torch.int64)), 0, (4,))
    with pytest.raises(OperatorError, match="row 2"):
        ops.random_uniform(_seeds([1, 2]), 2, (4,))
    with pytest.raises(OperatorError, match="floating-point"):
        ops.random_uniform(_seeds([1, 2]), 0, (4,), torch.int32)
