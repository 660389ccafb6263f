"""The graph cache's entry as bytes: a small record, then its large CPU tensors as raw bytes.

`dumps(record, tensors)` writes `record` (plain containers holding RunRecords, see
`kiln.frontend.torch.run_record.dumps`) and the tensors of `tensors` (by plain keys), whose bytes
follow the record unpickled: `loads` reads the record back with torch's weights-only
unpickler, and each tensor by one copy of its bytes into new memory (torch's allocator's
alignment, its dtype, sizes and strides as written). Reading a tensor so costs a copy, where
unpickling it costs the unpickler's work per tensor and more copies.

Layout: the record's length (8 bytes, little-endian), the record, then each tensor's bytes at
an offset (from the end of the record) that the record lists with its dtype, sizes and strides.
"""
from __future__ import annotations

import numpy as np
import torch

from kiln.frontend.torch.run_record import dumps as dumps_record, loads as loads_record

_LENGTH = 8


def packable(t: torch.Tensor) -> bool:
    """Whether `dumps` writes `t` as raw bytes: a dense CPU tensor that owns its whole storage
    (`kiln.runtime.plan.owned`) from its start."""
    return (t.device.type == "cpu" and t.layout == torch.strided and not t.is_quantized and not t.requires_grad
            and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.nbytes)


def dumps(record, tensors: dict) -> bytes:
    """`record` and `tensors` (each `packable`) as bytes (see the module's docstring)."""
    described, parts, offset = {}, [], 0
    for name, t in tensors.items():
        if not packable(t):
            raise ValueError(f"tensor {name!r} cannot be written as raw bytes")
        data = _storage_bytes(t)
        described[name] = (t.dtype, tuple(t.shape), tuple(t.stride()), offset, len(data))
        parts.append(data)
        offset += len(data)
    head = dumps_record({"record": record, "tensors": described})
    return b"".join([len(head).to_bytes(_LENGTH, "little"), head, *parts])


def loads(data: bytes) -> tuple[object, dict]:
    """The record and the tensors `dumps` wrote into `data`; a ValueError where `data` is not
    such bytes."""
    length = int.from_bytes(data[:_LENGTH], "little")
    if len(data) < _LENGTH + length:
        raise ValueError("the entry is shorter than its record")
    head = loads_record(memoryview(data)[_LENGTH:_LENGTH + length])
    start = _LENGTH + length
    tensors = {}
    for name, (dtype, shape, stride, offset, nbytes) in head["tensors"].items():
        if start + offset + nbytes > len(data):
            raise ValueError(f"the entry is shorter than its tensor {name!r}")
        flat = torch.empty(nbytes // dtype.itemsize, dtype=dtype)
        flat.view(torch.uint8).numpy()[:] = np.frombuffer(data, np.uint8, nbytes, start + offset)
        tensors[name] = flat.as_strided(shape, stride)
    return head["record"], tensors


def _storage_bytes(t: torch.Tensor) -> bytes:
    """The bytes of `t`'s whole storage."""
    raw = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
    return raw.numpy().tobytes()
