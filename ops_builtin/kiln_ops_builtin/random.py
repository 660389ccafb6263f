"""Random numbers from a counter-based generator: each element is a pure function of its flat
position and a 64-bit key, so any kernel (CPU or CUDA, in any order or split) draws the same
numbers for the same key, and no generator state lives on the device.

The key is a row of an int64 `seeds` tensor, two 32-bit words drawn by the caller from torch's
generator (`torch.manual_seed` makes runs repeatable; a fresh draw per call gives fresh
numbers). The mixing function is three rounds of a 32-bit avalanche hash (xor-shift and
multiply, Mueller's constants), each round keyed by one word: statistically uniform like
Philox, not bit-identical to torch's numbers. Every intermediate stays below 2**63, so the
arithmetic is exact in int64 on every target.
"""
from __future__ import annotations

import math

from kiln import dtypes
from kiln.graph import OperatorError, Traits, operator
from kiln.ir import cast, compute, cos, log, shift_right, sqrt

from kiln_ops_builtin.common import ravel

_WORD = 0xFFFFFFFF
_MULTIPLIER = 0x45D9F3B
_MANTISSA_BITS = 24  # of a float32: uniform on the grid k * 2**-24, as torch's float rand
# fewer bits for narrower types, so that no value rounds up to 1
_BITS = {dtypes.float16: 11, dtypes.bfloat16: 8}


def _avalanche(x):
    """A bijective mix of a 32-bit word held in an int64 (every output bit depends on every
    input bit)."""
    x = ((shift_right(x, 16) ^ x) * _MULTIPLIER) & _WORD
    x = ((shift_right(x, 16) ^ x) * _MULTIPLIER) & _WORD
    return shift_right(x, 16) ^ x


def random_bits(counter, key_low, key_high):
    """24 random bits (an int64 in [0, 2**24)) for position `counter` under a two-word key."""
    low = counter & _WORD
    high = shift_right(counter, 32)
    x = _avalanche(low ^ key_low)
    x = _avalanche(x ^ key_high)
    x = _avalanche((x + high) & _WORD ^ key_low)
    return shift_right(x, 32 - _MANTISSA_BITS)


@operator("random_uniform", traits=Traits(expensive=True))
def random_uniform(seeds, row, size, dtype=None):
    """A tensor of shape `size` uniform on [0, 1), keyed by `seeds[row]` (int64 words in
    [0, 2**32)); float32 unless `dtype` (a floating-point type) says otherwise."""
    t, shape = _checked("random_uniform", seeds, row, size, dtype, 1)
    bits = _BITS.get(t, _MANTISSA_BITS)
    scale = 1.0 / (1 << bits)

    def element(*i):
        counter = cast(ravel(i, shape), dtypes.int64) if shape else cast(0, dtypes.int64)
        value = shift_right(random_bits(counter, seeds[row, 0], seeds[row, 1]), _MANTISSA_BITS - bits)
        return cast(cast(value, dtypes.float32) * scale, t)
    return compute(shape, element)


@operator("random_normal", traits=Traits(expensive=True))
def random_normal(seeds, row, size, dtype=None):
    """A tensor of shape `size` of standard normal numbers, keyed by `seeds[row]` (as
    `random_uniform`); float32 unless `dtype` says otherwise. Element i is the Box-Muller
    transform of the float32 uniforms at counters 2i and 2i + 1: sqrt(-2 ln(1 - u)) cos(2 pi v)."""
    t, shape = _checked("random_normal", seeds, row, size, dtype, 2)
    scale = 1.0 / (1 << _MANTISSA_BITS)

    def element(*i):
        counter = 2 * cast(ravel(i, shape), dtypes.int64) if shape else cast(0, dtypes.int64)
        u, v = (cast(random_bits(c, seeds[row, 0], seeds[row, 1]), dtypes.float32) * scale
                for c in (counter, counter + 1))
        return cast(sqrt(log(1 - u) * -2.0) * cos(v * (2 * math.pi)), t)
    return compute(shape, element)


def _checked(op: str, seeds, row, size, dtype, per_element: int):
    """The dtype and shape of a random operator's result, its arguments checked."""
    if seeds.dtype != dtypes.int64 or seeds.ndim != 2 or seeds.shape[1] != 2:
        raise OperatorError(f"{op}: seeds must be an int64 tensor of shape (n, 2), got "
                            f"{seeds.dtype}{list(seeds.shape)}")
    if not isinstance(row, int) or not 0 <= row < seeds.shape[0]:
        raise OperatorError(f"{op}: row {row!r} is not a row of seeds {list(seeds.shape)}")
    if not all(isinstance(s, int) and s >= 0 for s in size):
        raise OperatorError(f"{op}: size must be non-negative ints, got {size!r}")
    t = dtypes.data_type(dtype) if dtype is not None else dtypes.float32
    if not t.is_float:
        raise OperatorError(f"{op}: dtype must be a floating-point type, got {t}")
    if math.prod(size) * per_element >= 1 << 40:
        raise OperatorError(f"{op}: {math.prod(size)} elements exceed the counter's 2**40")
    return t, tuple(size)
