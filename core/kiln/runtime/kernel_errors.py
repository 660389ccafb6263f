"""Errors that kernels detect in their inputs, raised as Python exceptions by the launcher.

A CPU kernel takes a status buffer of two int64 values, zero on entry: where one of its checks
fails, the first failing thread writes the check's code (from 1) and the value it reports
(the offending index, ...). After the call the launcher turns a nonzero code into the
exception of that check. Each exception class derives from both the Python exception a user
would expect (IndexError, ZeroDivisionError) and RuntimeError, which is what PyTorch raises
for several of these conditions (gather, integer division), so either `except` catches it.
"""
from __future__ import annotations

from dataclasses import dataclass


class KernelError(RuntimeError):
    """A kernel found its inputs invalid (an index out of range, an integer division by zero)."""


class KernelIndexError(KernelError, IndexError):
    """A kernel read an index out of range."""


class KernelZeroDivisionError(KernelError, ZeroDivisionError):
    """A kernel divided an integer by zero."""


KERNEL_ERRORS = {"RuntimeError": KernelError, "IndexError": KernelIndexError,
                 "ZeroDivisionError": KernelZeroDivisionError}


@dataclass(frozen=True)
class KernelCheck:
    """What a kernel's check number `code` (its position from 1) reports: the error's name in
    KERNEL_ERRORS and a message in which `{value}` stands for the reported value."""
    error: str
    message: str

    def exception(self, value: int) -> KernelError:
        return KERNEL_ERRORS[self.error](self.message.replace("{value}", str(value)))


def raise_failed(checks, code: int, value: int, kernel: str) -> None:
    """Raise the exception of check `code` of `checks` (nothing when `code` is 0)."""
    if code == 0:
        return
    if not 0 < code <= len(checks):
        raise KernelError(f"kernel '{kernel}' reported unknown error code {code}")
    raise checks[code - 1].exception(value)
