"""TMA tensor maps: the 128-byte descriptors Hopper's bulk tensor copies read, made on the host.

A kernel that loads tiles with `cp.async.bulk.tensor` takes a `const __grid_constant__
CUtensorMap` parameter by value. A launch names it with a `TensorMapArg` among its pointer
arguments (`kiln.schedule.cuda_program.Launch.args`): the buffer it describes, the dimensions and
strides (in elements, innermost first) and the box one copy moves. `encode` turns it into the
descriptor's bytes for the buffer's address through the driver (`cuTensorMapEncodeTiled`),
cached per (address, map), so a graph that runs again on the same buffers encodes nothing.
"""
from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass

from kiln import dtypes
from kiln.dtypes import DataType

TENSOR_MAP_BYTES = 128
_CACHE_LIMIT = 4096


@dataclass(frozen=True)
class TensorMapArg:
    """A tensor-map kernel argument over buffer `param` ('in0', ...): `dims` and `strides` in
    elements, innermost first (strides[0] must be 1), `box` the tile one copy loads, with
    128-byte swizzling (box[0] * element bytes must then be 128 at most)."""

    param: str
    dtype: DataType
    dims: tuple[int, ...]
    strides: tuple[int, ...]
    box: tuple[int, ...]
    swizzle: int = 128

    def __post_init__(self):
        rank = len(self.dims)
        if not (1 <= rank <= 5 and len(self.strides) == rank and len(self.box) == rank):
            raise ValueError(f"tensor map over {self.param}: rank {rank} (dims {self.dims}, strides "
                             f"{self.strides}, box {self.box}); TMA takes ranks 1 to 5 with one stride and box per dim")
        if self.strides[0] != 1 or any(s * self.dtype.nbytes % 16 for s in self.strides[1:]):
            raise ValueError(f"tensor map over {self.param}: strides {self.strides} (elements of "
                             f"{self.dtype.nbytes} bytes); TMA needs unit innermost stride and others multiples of 16 bytes")
        if any(not 1 <= b <= 256 for b in self.box) or self.box[0] * self.dtype.nbytes > self.swizzle:
            raise ValueError(f"tensor map over {self.param}: box {self.box}; each box dim must be 1..256 "
                             f"and the inner one at most {self.swizzle} bytes")


_DATA_TYPES = {dtypes.float16: "FLOAT16", dtypes.bfloat16: "BFLOAT16", dtypes.float32: "FLOAT32"}
_lock = threading.Lock()
_cache: dict[tuple, bytes] = {}


def encode(arg: TensorMapArg, address: int) -> bytes:
    """The 128 bytes of `arg`'s tensor map for the buffer at device `address` (16-byte aligned)."""
    key = (arg, address)
    found = _cache.get(key)
    if found is not None:
        return found
    from kiln.runtime.cuda import _bindings, _check
    driver, _ = _bindings()
    if address % 16:
        raise ValueError(f"tensor map over {arg.param}: address {address:#x} is not 16-byte aligned")
    names = getattr(driver.CUtensorMapDataType, f"CU_TENSOR_MAP_DATA_TYPE_{_DATA_TYPES[arg.dtype]}")
    swizzle = {128: "CU_TENSOR_MAP_SWIZZLE_128B", 64: "CU_TENSOR_MAP_SWIZZLE_64B",
               32: "CU_TENSOR_MAP_SWIZZLE_32B", 0: "CU_TENSOR_MAP_SWIZZLE_NONE"}[arg.swizzle]
    size = arg.dtype.nbytes
    tensor_map = _check(driver.cuTensorMapEncodeTiled(
        names, len(arg.dims), address, [driver.cuuint64_t(d) for d in arg.dims],
        [driver.cuuint64_t(s * size) for s in arg.strides[1:]], [driver.cuuint32_t(b) for b in arg.box],
        [driver.cuuint32_t(1)] * len(arg.dims), driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        getattr(driver.CUtensorMapSwizzle, swizzle),
        driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE),
        f"cuTensorMapEncodeTiled({arg.param}: dims {arg.dims}, strides {arg.strides}, box {arg.box})")
    raw = ctypes.string_at(tensor_map.getPtr(), TENSOR_MAP_BYTES)
    with _lock:
        if len(_cache) >= _CACHE_LIMIT:
            _cache.clear()
        _cache[key] = raw
    return raw


def resolve(arg, buffers: dict[str, int]):
    """A launch argument's value: a buffer's address, or a tensor map's bytes over its buffer."""
    if isinstance(arg, TensorMapArg):
        return encode(arg, buffers[arg.param])
    return buffers[arg]
