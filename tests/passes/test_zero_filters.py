"""Zero channels computed by the convolution (`kiln_ops_builtin.passes.zero_filters`): a pad appending zero
channels after a convolution and a chain of zero-keeping element-wise operators disappears into
the convolution's zero filters, with the same values; chains that would not keep zeros zero,
or that others read, keep their pad."""
import pytest
import torch

import kiln
from kiln_ops_builtin.passes.zero_filters import ZeroFilters
from tests.passes.passes_support import apply, names, run_both

ops = kiln.ops


def _squeeze(x, chain, bias=True):
    """A 1x1 convolution to 6 channels, `chain`, zero channels up to 8, a 1x1 convolution."""
    torch.manual_seed(0)
    w1, b1 = kiln.from_torch(torch.randn(6, 1, 1, 16)), kiln.from_torch(torch.randn(6)) if bias else None
    w2 = kiln.from_torch(torch.randn(16, 1, 1, 8))
    return ops.conv2d_channels_last(ops.pad(chain(ops.conv2d_channels_last(x, w1, b1)), [0, 2]), w2)


SCALE, SHIFT = kiln.from_torch(torch.rand(6) + 0.5), kiln.from_torch(torch.randn(1, 1, 1, 6))


@pytest.mark.parametrize("chain", [
    ops.silu, lambda v: ops.relu(ops.add(ops.mul(v, SCALE), SHIFT)), lambda v: ops.mul(ops.gelu(v), 0.5),
    lambda v: ops.cast(ops.hardswish(ops.sub(v, SHIFT)), torch.float32), lambda v: v,
], ids=["silu", "affine-relu", "gelu-half", "sub-hardswish-cast", "none"])
def test_the_convolution_computes_the_zero_channels(chain):
    x = kiln.symbol([2, 5, 7, 16])
    graph = kiln.trace_from([_squeeze(x, chain)], [x])
    out = apply(ZeroFilters(), graph)
    assert "Pad" in names(graph) and "Pad" not in names(out)
    run_both(graph, out, kiln.from_torch(torch.randn(2, 5, 7, 16)), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("chain", [
    ops.sigmoid,                                      # sigmoid(0) = 1/2
    lambda v: ops.add(v, 1.0),                        # a number added
    lambda v: ops.add(v, kiln.from_torch(torch.randn(1, 1, 1, 1))),
    lambda v: ops.mul(v, kiln.from_torch(torch.randn(1, 5, 1, 6))),   # varies along a row
])
def test_chains_that_would_not_keep_zeros_keep_their_pad(chain):
    x = kiln.symbol([2, 5, 7, 16])
    graph = kiln.trace_from([_squeeze(x, chain)], [x])
    assert names(apply(ZeroFilters(), graph)) == names(graph)


def test_a_chain_value_read_elsewhere_keeps_its_pad():
    x = kiln.symbol([2, 5, 7, 16])
    seen = []
    graph = kiln.trace_from([_squeeze(x, lambda v: seen.append(ops.silu(v)) or seen[0]), ops.sum(seen[0], [3])], [x])
    assert names(apply(ZeroFilters(), graph)) == names(graph)
