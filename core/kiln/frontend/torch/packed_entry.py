"""The graph cache's entry as bytes: a small record, then its tensors as raw bytes.

`dumps(record, tensors)` writes `record` (plain containers holding RunRecords, see
`kiln.frontend.torch.run_record.dumps`) and the tensors of `tensors` (by plain keys), whose bytes
follow the record unpickled: `loads` reads the record back with torch's weights-only
unpickler, and each tensor as a view of the entry's own bytes (its dtype, sizes and strides as
written) where those are writable memory aligned as torch's allocator aligns (as
`kiln.runtime.cache.read_entry` returns them), else of one copy of them. Reading a CPU tensor
so costs nothing, where unpickling it costs the unpickler's work per tensor and copies; the
tensors share the entry's memory, which lives as long as any of them. A GPU tensor's bytes are
written from the host and copied to its device when read.

Layout: the record's length (8 bytes, little-endian), the record, padding to a multiple of
`ALIGNMENT` bytes, then each tensor's bytes at an offset (from there, a multiple of
`ALIGNMENT`) that the record lists with its dtype, sizes, strides and device.
"""
from __future__ import annotations

import numpy as np
import torch

from kiln.frontend.torch.run_record import dumps as dumps_record, loads as loads_record

_LENGTH = 8
ALIGNMENT = 64
"""The alignment of each tensor's bytes from the entry's start (torch's CPU allocator's: the
kernels' vector loads and stores may assume it)."""


def packable(t: torch.Tensor) -> bool:
    """Whether `dumps` writes `t` as raw bytes: a dense tensor that owns its whole storage
    (`kiln.runtime.plan.owned`) from its start."""
    return (t.layout == torch.strided and not t.is_quantized and not t.requires_grad
            and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.nbytes)


def dumps(record, tensors: dict) -> bytes:
    """`record` and `tensors` (each `packable`) as bytes (see the module's docstring)."""
    described, parts, offset = {}, [], 0
    for name, t in tensors.items():
        if not packable(t):
            raise ValueError(f"tensor {name!r} cannot be written as raw bytes")
        data = _storage_bytes(t)
        described[name] = (t.dtype, tuple(t.shape), tuple(t.stride()), offset, len(data), str(t.device))
        parts += [data, bytes(_padding(len(data)))]
        offset += len(data) + _padding(len(data))
    head = dumps_record({"record": record, "tensors": described})
    return b"".join([len(head).to_bytes(_LENGTH, "little"), head, bytes(_padding(_LENGTH + len(head))), *parts])


def loads(data) -> tuple[object, dict]:
    """The record and the tensors `dumps` wrote into `data` (bytes, or any buffer); a ValueError
    where `data` is not such bytes."""
    view = memoryview(data)
    length = int.from_bytes(view[:_LENGTH], "little")
    if len(view) < _LENGTH + length:
        raise ValueError("the entry is shorter than its record")
    head = loads_record(view[_LENGTH:_LENGTH + length])
    start = _LENGTH + length + _padding(_LENGTH + length)
    end = max((start + offset + nbytes + _padding(nbytes) for _, _, _, offset, nbytes, _ in head["tensors"].values()),
              default=start)
    if len(view) != end:
        raise ValueError(f"the entry has {len(view)} bytes, its record describes {end}")
    whole = _aligned(view) if head["tensors"] else None
    tensors = {}
    for name, (dtype, shape, stride, offset, nbytes, device) in head["tensors"].items():
        flat = whole[start + offset:start + offset + nbytes].view(dtype)
        if len(shape) != len(stride) or _extent(shape, stride) > flat.numel():
            raise ValueError(f"tensor {name!r}: sizes {shape} and strides {stride} reach beyond its bytes")
        tensors[name] = flat.as_strided(shape, stride).to(device)
    return head["record"], tensors


def _extent(shape, stride) -> float:
    """The elements a tensor of sizes `shape` and non-negative strides `stride` spans."""
    if any(d < 0 for d in (*shape, *stride)):
        return float("inf")
    return 0 if 0 in shape else 1 + sum((d - 1) * s for d, s in zip(shape, stride))


def _padding(size: int) -> int:
    """The bytes that bring `size` to a multiple of ALIGNMENT."""
    return -size % ALIGNMENT


def _aligned(view: memoryview) -> torch.Tensor:
    """`view`'s bytes as a tensor: sharing its memory where that is writable and aligned, else a
    copy in memory of torch's allocator."""
    if not view.readonly:
        whole = torch.frombuffer(view, dtype=torch.uint8)
        if whole.data_ptr() % ALIGNMENT == 0:
            return whole
    whole = torch.empty(len(view), dtype=torch.uint8)
    whole.numpy()[:] = np.frombuffer(view, np.uint8)
    return whole


def _storage_bytes(t: torch.Tensor) -> bytes:
    """The bytes of `t`'s whole storage (copied to the host from a GPU's)."""
    raw = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage()).cpu()
    return raw.numpy().tobytes()
