"""Devices: the CPU and CUDA GPUs."""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch


@dataclass(frozen=True)
class Device:
    """A device: kind 'cpu' or 'cuda', with an index for CUDA devices."""

    kind: str
    index: int = 0

    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"

    def torch(self) -> torch.device:
        return torch.device("cpu") if self.kind == "cpu" else torch.device("cuda", self.index)

    def __str__(self) -> str:
        return "cpu" if self.kind == "cpu" else f"cuda:{self.index}"

    def __repr__(self) -> str:
        return f"Device('{self}')"


def device(value) -> Device:
    """Return the Device for a Device, a string ('cpu', 'cuda', 'cuda:1') or a torch.device."""
    if isinstance(value, Device):
        return value
    if value is None:
        return Device("cpu")
    if isinstance(value, torch.device):
        if value.type == "cuda" and value.index is None:     # the current device: not cached
            value = str(value)
        else:
            return _of_torch_device(value)
    if isinstance(value, str):
        kind, _, index = value.partition(":")
        if kind == "cpu" and not index:
            return Device("cpu")
        if kind == "cuda":
            if index:
                return Device("cuda", int(index))
            return Device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
    raise ValueError(f"unknown device {value!r}; expected 'cpu', 'cuda' or 'cuda:N'")


@lru_cache(maxsize=None)
def _of_torch_device(value: torch.device) -> Device:
    """The Device of a torch.device that names its index (every tensor's does): `device()`'s per
    call cost on the path of every graph run's outputs."""
    return device(str(value))
