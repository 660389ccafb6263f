"""Building and loading CPU kernels: the system C compiler and ctypes."""
from __future__ import annotations

import ctypes
import functools
import os
import platform
import shutil
import subprocess
from pathlib import Path
from typing import Sequence

from kiln.runtime.cache import content_key, lookup_or_build
from kiln.runtime.kernel_errors import KernelCheck, raise_failed

FLAGS = ["-O3", "-std=gnu11", "-fPIC", "-shared", "-fopenmp", "-fwrapv", "-fno-math-errno",
         "-march=native"]


class BuildError(RuntimeError):
    """A kernel failed to compile; the message holds the compiler's log and the source."""


@functools.lru_cache(maxsize=None)
def compiler() -> tuple[str, str, str]:
    """(path, version, target architecture) of the C compiler; $CC overrides."""
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise BuildError("Kiln's CPU backend needs a C compiler: install gcc (or set $CC)")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    arch = subprocess.run([cc, "-march=native", "-Q", "--help=target"], capture_output=True, text=True).stdout
    march = next((ln.split()[-1] for ln in arch.splitlines() if ln.strip().startswith("-march=")), "")
    return cc, version, f"{platform.machine()}-{march}"


def _numbered(source: str) -> str:
    return "\n".join(f"{n:5d} | {line}" for n, line in enumerate(source.splitlines(), 1))


def build_shared_library(source: str, name: str) -> Path:
    """Compile C `source` to a shared library through the kernel cache; return its path."""
    cc, version, arch = compiler()
    key = content_key("c", source, cc, version, " ".join(FLAGS), arch)

    def build(out: Path) -> None:
        src = out.with_suffix(".c")
        src.write_text(source)
        try:
            proc = subprocess.run([cc, *FLAGS, str(src), "-o", str(out), "-lm"],
                                  capture_output=True, text=True)
        finally:
            src.unlink(missing_ok=True)
        if proc.returncode != 0:
            raise BuildError(f"C compiler failed on kernel '{name}':\n{proc.stderr}\n--- source ---\n"
                             f"{_numbered(source)}")

    return lookup_or_build("cpu", key, ".so", build)


class CpuKernel:
    """A loaded CPU kernel: call it with raw pointers (ints) of its buffers in order. The C
    function takes a status buffer after them; a check that fails there raises its exception
    (`checks`, by code; see `kiln.runtime.kernel_errors`)."""

    def __init__(self, source: str, name: str, num_args: int, checks: Sequence[KernelCheck] = ()):
        self.source = source
        self.name = name
        self.checks = list(checks)
        self.path = build_shared_library(source, name)
        self._lib = ctypes.CDLL(str(self.path))
        self._fn = getattr(self._lib, name)
        self._fn.restype = None
        self._fn.argtypes = [ctypes.c_void_p] * (num_args + 1)

    def __call__(self, *pointers: int) -> None:
        status = (ctypes.c_int64 * 2)()
        self._fn(*pointers, ctypes.addressof(status))
        raise_failed(self.checks, status[0], status[1], self.name)
