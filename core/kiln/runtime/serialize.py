"""Records as bytes: what the whole-graph cache stores and `kiln.save` writes.

`dumps(record)` pickles `record` (plain containers, plain values, torch's dtypes, devices,
sizes, layouts and memory formats, tensors, and instances of the data classes its reader names) with every tensor taken out
of the pickle: each is written as its raw bytes after it, and the pickle holds where they lie
with the tensor's dtype, sizes, strides and device. `loads(data, classes)` reads it back with
Python's own unpickler restricted to those globals: a pickle naming any other class or
function is refused before anything in it runs, as torch's weights-only unpickler refuses it,
at a fraction of its cost. A CPU tensor comes back as a view of `data` where that is writable
memory aligned as torch's allocator aligns (as `kiln.runtime.cache.read_entry` and `read_file`
return it), else of one copy of it; a GPU tensor's bytes are copied to its device. A tensor that
appears twice in a record comes back as one. Tensors come back detached, as plain tensors (a
Parameter as its data).

Layout: the pickle's length (8 bytes, little-endian), the pickle, padding to a multiple of
`ALIGNMENT` bytes, then each tensor's bytes at an offset (from there) that is a multiple of
`ALIGNMENT`.
"""
from __future__ import annotations

import collections
import gc
import io
import pickle
from typing import Sequence

import numpy as np
import torch

_LENGTH = 8
ALIGNMENT = 64
"""The alignment of each tensor's bytes from the record's start (torch's CPU allocator's: the
kernels' vector loads and stores may assume it)."""

_PLAIN = {**{("builtins", kind.__name__): kind for kind in (slice, range, complex)}, ("builtins", "Ellipsis"): ...,
          ("collections", "OrderedDict"): collections.OrderedDict,
          ("torch", "device"): torch.device, ("torch", "Size"): torch.Size,
          ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
          **{("torch", name): value for name, value in vars(torch).items() if isinstance(value, torch.dtype)},
          **{("torch._utils", f"torch.{name}"): value for name, value in vars(torch).items()
             if isinstance(value, torch.memory_format)}}
"""The globals any record may name besides its classes: as pickle names them (a memory format
by `torch._utils`, a layout through `torch.serialization._get_layout`)."""


def dumps(record) -> bytes:
    """`record` as bytes (see the module's docstring); ValueError for a tensor that is not a
    dense one of a strided layout."""
    out = io.BytesIO()
    pickler = _Pickler(out)
    pickler.dump(record)
    head = out.getvalue()
    return b"".join([len(head).to_bytes(_LENGTH, "little"), head, bytes(_padding(_LENGTH + len(head))),
                     *pickler.parts])


def loads(data, classes: Sequence[type] = ()):
    """The record `dumps` wrote into `data` (bytes, or any buffer), building no class or
    function but `classes` and the plain ones of the module's docstring; pickle.UnpicklingError
    where `data` is not such a record. Python's cyclic garbage collector is off meanwhile: the
    unpickler makes no garbage, but its many new objects would set off collections, each a walk
    over the objects of a process that may have traced a model."""
    view = memoryview(data)
    length = int.from_bytes(view[:_LENGTH], "little")
    start = _LENGTH + length + _padding(_LENGTH + length)
    if len(view) < start:
        raise pickle.UnpicklingError("the record is shorter than its pickle")
    unpickler = _Unpickler(view, start, classes)
    collecting = gc.isenabled()
    gc.disable()
    try:
        record = unpickler.load()
    except (EOFError, ValueError, TypeError, KeyError, IndexError, AttributeError, RuntimeError) as error:
        raise pickle.UnpicklingError(f"the record cannot be read back ({type(error).__name__}: {error})") from None
    finally:
        if collecting:
            gc.enable()
    if unpickler.end != len(view):
        raise pickle.UnpicklingError(f"the record has {len(view)} bytes, its pickle describes {unpickler.end}")
    return record


class _Pickler(pickle.Pickler):
    """Pickles a record, its tensors' bytes set apart in `parts` (each padded to ALIGNMENT)."""

    def __init__(self, file):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.parts: list[bytes] = []
        self.offset = 0
        self.written: dict[int, tuple] = {}
        self.kept: list[torch.Tensor] = []     # alive while pickling, so that no id is reused

    def persistent_id(self, obj):
        if not isinstance(obj, torch.Tensor):
            return None
        if id(obj) not in self.written:
            if obj.layout != torch.strided or obj.is_quantized or obj.is_sparse or obj.device.type == "meta":
                raise ValueError(f"a {obj.layout} tensor of {obj.dtype} on {obj.device} cannot be written "
                                 "as raw bytes")
            t = obj.detach().resolve_conj().resolve_neg()
            if t.storage_offset() != 0 or t.untyped_storage().nbytes() != t.nbytes:
                t = t.clone()       # a view: its own elements only
            data = _storage_bytes(t)
            self.written[id(obj)] = ("tensor", t.dtype, tuple(t.shape), tuple(t.stride()), self.offset,
                                     len(data), str(t.device))
            self.kept.append(obj)
            self.parts += [data, bytes(_padding(len(data)))]
            self.offset += len(data) + _padding(len(data))
        return self.written[id(obj)]


class _Unpickler(pickle.Unpickler):
    """Reads a record back, building only the classes allowed, its tensors from the bytes after
    the pickle (which begin at `start` of `view`)."""

    def __init__(self, view: memoryview, start: int, classes: Sequence[type]):
        super().__init__(io.BytesIO(view[_LENGTH:start]))
        self.view, self.start, self.end = view, start, start
        self.allowed = {**_PLAIN, **{(c.__module__, c.__qualname__): c for c in classes}}
        self.whole: torch.Tensor | None = None
        self.read: dict[tuple, torch.Tensor] = {}

    def find_class(self, module: str, name: str):
        found = self.allowed.get((module, name))
        if found is None:
            raise pickle.UnpicklingError(f"the record names {module}.{name}, which a record may not hold")
        return found

    def persistent_load(self, pid):
        if pid in self.read:
            return self.read[pid]
        kind, dtype, shape, stride, offset, nbytes, device = pid
        begin = self.start + offset
        if (kind != "tensor" or not isinstance(dtype, torch.dtype) or offset % ALIGNMENT or offset < 0
                or begin + nbytes > len(self.view) or nbytes % dtype.itemsize):
            raise pickle.UnpicklingError(f"a tensor of the record lies outside its bytes: {pid}")
        if len(shape) != len(stride) or _extent(shape, stride) > nbytes // dtype.itemsize:
            raise pickle.UnpicklingError(f"a tensor's sizes {shape} and strides {stride} reach beyond its bytes")
        if self.whole is None:
            self.whole = _aligned(self.view)
        flat = self.whole[begin:begin + nbytes].view(dtype)
        self.read[pid] = t = flat.as_strided(shape, stride).to(device)
        self.end = max(self.end, begin + nbytes + _padding(nbytes))
        return t


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
