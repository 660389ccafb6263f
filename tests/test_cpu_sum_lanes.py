"""Float sums on the CPU add a block's consecutive values into SUM_LANES partial sums (one
vector register) before the cascade (`kiln.schedule.cpu_auto`): lengths that leave a
remainder, sums over several axes, 16-bit inputs, all against PyTorch."""
import pytest
import torch

import kiln
from kiln.schedule import cpu_auto
from kiln.schedule.choose import auto_program
from tests.support import rand


@pytest.mark.parametrize("shape,dim", [((5, 1001), 1), ((129, 3), 0), ((7, 13, 11), (0, 2)),
                                       ((3, 17, 19, 5), (1, 2, 3))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_sums_with_remainders_match_torch(shape, dim, dtype):
    torch.manual_seed(0)
    x = rand(shape, dtype)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(kiln.ops.sum(x, dim).torch(), x.sum(dim), atol=tol, rtol=tol)
    strided = rand(tuple(s * 2 for s in shape), dtype)[tuple(slice(None, None, 2) for _ in shape)]
    torch.testing.assert_close(kiln.ops.sum(strided, dim).torch(), strided.sum(dim), atol=tol, rtol=tol)


def test_long_sums_use_the_partial_sum_lanes():
    x = kiln.symbol([4, 1001])
    source = auto_program(kiln.ops.sum(x, 1).trace[0].task, "cpu").source
    assert f"[{cpu_auto.SUM_LANES}] = {{0.0f}};" in source
