"""Kiln tensors: concrete ones hold a torch tensor as storage; symbolic ones record a trace.

Storage is a torch tensor, so `from_torch` and `Tensor.torch()` share memory and Kiln allocates
through PyTorch's caching allocator. `recording_reads()` tells which tensors' values were asked
for while it is active (what a compile's result may depend on beyond shapes and dtypes).
"""
from __future__ import annotations

import operator as python
import threading
from contextlib import contextmanager
from typing import Callable, Iterator, Sequence

import numpy as np
import torch

from kiln import dtypes
from kiln.device import Device, device as as_device
from kiln.dtypes import DataType
from kiln.ir.size import as_dim
from kiln.runtime import folds


class Tensor:
    """An n-dimensional array with a shape, dtype and device.

    A dimension that changes from run to run is a `kiln.ir.size.SymSize` (an int that also
    knows its expression over run-time sizes). `storage` is None for a symbolic tensor; `trace` is `(operator, index)` for a tensor an
    operator produced in a traced graph, None otherwise. `generated` says that the values
    depend on no data, only on shapes and attributes (a fill, a range, a mask made of them):
    a graph may compute such a tensor where it is used instead of holding it.
    """

    def __init__(self, shape: Sequence[int], dtype, device, storage: torch.Tensor | None = None,
                 trace=None, generated: bool = False):
        self.shape = tuple(map(as_dim, shape))
        self.dtype: DataType = dtypes.data_type(dtype)
        self.device: Device = as_device(device)
        self.storage = storage
        self.trace = trace
        self.generated = generated

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def is_symbolic(self) -> bool:
        return self.storage is None

    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def torch(self) -> torch.Tensor:
        """The torch tensor holding this tensor's values (shares memory)."""
        if self.storage is None:
            raise ValueError("a symbolic tensor has no values; run the graph it belongs to")
        if _recorders:
            read = {id(self.storage), *map(id, folds.sources(self.storage))}
            for reads in _recorders:
                reads |= read
        return self.storage

    def numpy(self) -> np.ndarray:
        """The values as a NumPy array (bfloat16 becomes float32, which NumPy lacks)."""
        t = self.torch().detach().cpu()
        if t.dtype == torch.bfloat16:
            t = t.float()
        return t.numpy()

    def signature(self) -> str:
        dev = self.device.kind
        return f"{self.dtype}{list(self.shape)}[{dev}]"

    def __repr__(self) -> str:
        head = f"Tensor(shape={self.shape}, dtype='{self.dtype}', device='{self.device}')"
        if self.storage is None:
            return head if self.trace is None else f"{head}\nfrom {self.trace}"
        return head + "\n" + np.array2string(self.numpy(), precision=2, suppress_small=True)

    # Python operators apply the Kiln operator implementing them (see `use_operators`)
    def _op(self, job, *args):
        if _implementing is None:
            raise RuntimeError(f"Tensor operators need kiln.ops: import kiln (to apply operator.{job.__name__})")
        return _implementing(job)(*args)

    def __add__(self, o): return self._op(python.add, self, o)
    def __radd__(self, o): return self._op(python.add, o, self)
    def __sub__(self, o): return self._op(python.sub, self, o)
    def __rsub__(self, o): return self._op(python.sub, o, self)
    def __mul__(self, o): return self._op(python.mul, self, o)
    def __rmul__(self, o): return self._op(python.mul, o, self)
    def __truediv__(self, o): return self._op(python.truediv, self, o)
    def __rtruediv__(self, o): return self._op(python.truediv, o, self)
    def __floordiv__(self, o): return self._op(python.floordiv, self, o)
    def __rfloordiv__(self, o): return self._op(python.floordiv, o, self)
    def __mod__(self, o): return self._op(python.mod, self, o)
    def __rmod__(self, o): return self._op(python.mod, o, self)
    def __pow__(self, o): return self._op(python.pow, self, o)
    def __rpow__(self, o): return self._op(python.pow, o, self)
    def __matmul__(self, o): return self._op(python.matmul, self, o)
    def __neg__(self): return self._op(python.neg, self)
    def __abs__(self): return self._op(python.abs, self)
    def __invert__(self): return self._op(python.invert, self)
    def __and__(self, o): return self._op(python.and_, self, o)
    def __rand__(self, o): return self._op(python.and_, o, self)
    def __or__(self, o): return self._op(python.or_, self, o)
    def __ror__(self, o): return self._op(python.or_, o, self)
    def __xor__(self, o): return self._op(python.xor, self, o)
    def __rxor__(self, o): return self._op(python.xor, o, self)
    def __lt__(self, o): return self._op(python.lt, self, o)
    def __le__(self, o): return self._op(python.le, self, o)
    def __gt__(self, o): return self._op(python.gt, self, o)
    def __ge__(self, o): return self._op(python.ge, self, o)
    def __eq__(self, o): return self._op(python.eq, self, o)
    def __ne__(self, o): return self._op(python.ne, self, o)
    __hash__ = object.__hash__

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d tensor")
        return self.shape[0]


_recorders: tuple[set[int], ...] = ()      # replaced, never changed: readers see a whole one
_recorders_lock = threading.Lock()


@contextmanager
def recording_reads() -> Iterator[set[int]]:
    """A set that collects, until the block ends, the ids of the torch tensors whose values are
    asked for (`Tensor.torch()`, and so `numpy()`) in any thread: a Tensor's storage, and where
    a kernel run at compile time computed it, the tensors it was computed from
    (`kiln.runtime.folds.sources`). A kernel's own run reads no values: `kiln.runtime.folds`
    records how it computed its outputs instead."""
    global _recorders
    reads: set[int] = set()
    with _recorders_lock:
        _recorders = (*_recorders, reads)
    try:
        yield reads
    finally:
        with _recorders_lock:
            _recorders = tuple(r for r in _recorders if r is not reads)


_implementing: Callable[[Callable], Callable] | None = None


def use_operators(implementing: Callable[[Callable], Callable]) -> None:
    """Make `implementing(f)` what Tensor's Python operators apply, `f` the function of Python's
    `operator` module they stand for (`a + b` applies `implementing(operator.add)(a, b)`).

    Operators come from plugins, a layer above tensors; `kiln.ops` installs its lookup here when
    it is imported, which `import kiln` always does.
    """
    global _implementing
    _implementing = implementing


def from_torch(t: torch.Tensor) -> Tensor:
    """A Kiln tensor sharing memory with the torch tensor `t`."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"from_torch expects a torch.Tensor, got {type(t).__name__}")
    return Tensor(t.shape, dtypes.data_type(t.dtype), as_device(t.device), storage=t)


def _full(shape, value, dtype, device) -> Tensor:
    d = dtypes.data_type(dtype)
    return from_torch(torch.full(tuple(shape), value, dtype=d.torch_dtype, device=as_device(device).torch()))


def empty(shape, dtype="float32", device="cpu") -> Tensor:
    """An uninitialized tensor."""
    d = dtypes.data_type(dtype)
    return from_torch(torch.empty(tuple(shape), dtype=d.torch_dtype, device=as_device(device).torch()))


def zeros(shape, dtype="float32", device="cpu") -> Tensor:
    """A tensor of zeros."""
    return _full(shape, 0, dtype, device)


def ones(shape, dtype="float32", device="cpu") -> Tensor:
    """A tensor of ones."""
    return _full(shape, 1, dtype, device)


def full(shape, fill_value, dtype="float32", device="cpu") -> Tensor:
    """A tensor filled with `fill_value`."""
    return _full(shape, fill_value, dtype, device)


def randn(shape, dtype="float32", device="cpu", mean=0.0, stddev=1.0) -> Tensor:
    """A tensor of normally distributed random values."""
    d = dtypes.data_type(dtype)
    if not d.is_float:
        raise TypeError(f"randn makes floating-point tensors, not {d}")
    t = torch.randn(tuple(shape), dtype=d.torch_dtype, device=as_device(device).torch())
    return from_torch(t * stddev + mean)


def asarray(data, dtype=None, device="cpu") -> Tensor:
    """A tensor from a Python list, a NumPy array, a scalar or a torch tensor (copied)."""
    if isinstance(data, Tensor):
        data = data.torch()
    torch_dtype = dtypes.data_type(dtype).torch_dtype if dtype is not None else None
    if isinstance(data, np.ndarray):
        t = torch.from_numpy(np.ascontiguousarray(data)).clone()
    elif isinstance(data, torch.Tensor):
        t = data.clone()
    else:
        t = torch.tensor(data)
    if torch_dtype is not None:
        t = t.to(torch_dtype)
    return from_torch(t.to(as_device(device).torch()))


def symbol(shape, dtype="float32", device="cpu") -> Tensor:
    """A symbolic tensor: operators on it record a graph instead of computing."""
    return Tensor(shape, dtype, device)


def symbol_like(t: Tensor) -> Tensor:
    """A symbolic tensor with the shape, dtype and device of `t`."""
    return Tensor(t.shape, t.dtype, t.device)
