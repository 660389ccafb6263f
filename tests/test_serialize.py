"""kiln.runtime.serialize: records as bytes, their tensors as raw bytes, read back building only
the classes allowed."""
import collections
import gc
import mmap
import pickle
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from kiln.runtime import serialize


@dataclass
class Step:
    name: str
    sizes: tuple


def test_a_records_values_and_tensors_come_back_as_written():
    base = torch.randn(8)
    tensors = {0: torch.randn(3, 5).t(), 1: torch.randn(4).to(torch.bfloat16), 2: torch.tensor(True),
               3: torch.empty(0, 7), 4: torch.arange(6, dtype=torch.int64).reshape(2, 3), 5: base[2:5],
               6: torch.nn.Parameter(torch.randn(2, 2))}
    record = {"steps": [Step("a", (2, 3)), Step("b", ())], "dtype": torch.float16, "device": torch.device("cpu"),
              "size": torch.Size([4, 5]), "where": slice(1, 9, 2), "tensors": tensors, "again": tensors[0],
              "plain": [..., range(3), 2j, {1, 2}, frozenset({3}), b"\x00", bytearray(b"x"), None, True, 1.5],
              "ordered": collections.OrderedDict(a=1), "formats": [torch.channels_last, torch.strided, torch.bfloat16]}
    back = serialize.loads(serialize.dumps(record), classes=(Step,))
    assert {k: v for k, v in back.items() if k not in ("tensors", "again")} == \
        {k: v for k, v in record.items() if k not in ("tensors", "again")}
    for k, t in tensors.items():
        got = back["tensors"][k]
        assert type(got) is torch.Tensor and not got.requires_grad
        assert got.dtype == t.dtype and got.shape == t.shape and torch.equal(got, t.detach())
        assert got.data_ptr() % serialize.ALIGNMENT == 0
    assert back["tensors"][0].stride() == (1, 5)           # as written, not made contiguous
    assert back["again"] is back["tensors"][0]             # one tensor, not two copies


def test_tensors_are_views_of_the_records_memory_where_that_is_aligned_and_writable():
    tensors = {0: torch.randn(5, 3), 1: torch.arange(9, dtype=torch.int32)}
    data = serialize.dumps(tensors)
    memory = mmap.mmap(-1, len(data))
    memory[:] = data
    found = serialize.loads(memoryview(memory))
    start = torch.frombuffer(memory, dtype=torch.uint8).data_ptr()
    for k, t in tensors.items():
        assert start <= found[k].data_ptr() < start + len(data) and torch.equal(found[k], t)
    del memory
    gc.collect()
    assert all(torch.equal(found[k], t) for k, t in tensors.items())     # the tensors keep the memory
    copied = serialize.loads(data)                                       # bytes are read-only: copied
    assert all(torch.equal(copied[k], t) for k, t in tensors.items())


@pytest.mark.cuda
def test_gpu_tensors_come_back_on_their_gpu():
    tensors = {0: torch.randn(3, 5, device="cuda").t(), 1: torch.tensor(2.5, device="cuda"), 2: torch.randn(4)}
    found = serialize.loads(serialize.dumps(tensors))
    for k, t in tensors.items():
        assert found[k].device == t.device and found[k].stride() == t.stride() and torch.equal(found[k], t)


def test_tensors_that_cannot_be_written_as_raw_bytes_are_refused():
    with pytest.raises(ValueError, match="cannot be written as raw bytes"):
        serialize.dumps({"x": torch.randn(4, 4).to_sparse()})


class _Runs:
    """Unpickled, it would create a file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


@pytest.mark.parametrize("what", ["a function", "a class not allowed", "a torch function"])
def test_a_record_naming_other_globals_is_refused_before_anything_runs(tmp_path, what):
    marker = tmp_path / "ran"
    record = {"a function": _Runs(marker), "a class not allowed": Step("a", ()),
              "a torch function": torch.zeros}[what]
    with pytest.raises(pickle.UnpicklingError, match="which a record may not hold"):
        serialize.loads(serialize.dumps([record]))
    assert not marker.exists()


def test_damaged_records_are_refused():
    data = serialize.dumps({"x": torch.randn(3), "n": 4})
    for damaged in (data[:-4], data + bytes(64), data[:8] + b"\x00" * 16 + data[24:], b"", data[:5]):
        with pytest.raises(pickle.UnpicklingError):
            serialize.loads(damaged)


@pytest.mark.parametrize("shape, stride", [((3, 5), (5, 1)), ((2, 3), (-1, 1)), ((4,), (1, 1))])
def test_a_tensor_reaching_beyond_its_bytes_is_refused(shape, stride):
    """A record describing a tensor larger than its bytes would view the bytes after them (torch
    checks a view against its whole storage, the record's): the record is refused."""
    other = torch.randn(64)

    class Forged(serialize._Pickler):
        def persistent_id(self, obj):
            pid = super().persistent_id(obj)
            return pid if pid is None or obj is other else (*pid[:2], shape, stride, *pid[4:])
    out = serialize.io.BytesIO()
    pickler = Forged(out)
    pickler.dump({"x": torch.randn(2, 3), "y": other})
    head = out.getvalue()
    data = b"".join([len(head).to_bytes(8, "little"), head, bytes(serialize._padding(8 + len(head))), *pickler.parts])
    with pytest.raises(pickle.UnpicklingError, match="reach beyond its bytes"):
        serialize.loads(data)


def test_reading_a_record_back_sets_off_no_garbage_collection():
    """Unpickling makes many objects and no garbage: the full collections they would set off walk
    every object of a process that has traced a model."""
    data = serialize.dumps({"rows": [list(range(20)) for _ in range(3000)], "x": torch.randn(3)})
    started = []

    def count(phase, info):
        if phase == "start":
            started.append(info["generation"])
    threshold = gc.get_threshold()
    gc.callbacks.append(count)
    gc.set_threshold(10)
    try:
        serialize.loads(data)
        assert started == [] and gc.isenabled()
        [list(range(20)) for _ in range(3000)]
        assert started, "the collector ran without the pause"
    finally:
        gc.callbacks.remove(count)
        gc.set_threshold(*threshold)
