"""Building and loading CPU kernels: the system C compiler and ctypes."""
from __future__ import annotations

import ctypes
import functools
import os
import platform
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch

from kiln.codegen.emitter import KernelArgs
from kiln.runtime.cache import content_key, lookup_or_build

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


@dataclass(frozen=True)
class CpuProgram:
    """What a CPU schedule produces: C `source` defining `void entry(...)`, whose parameters
    are pointers to the buffers named by `args` in order (kernel argument names of
    `kiln.codegen.emitter.KernelArgs`: the task's inputs, then its outputs)."""

    source: str
    entry: str
    args: tuple[str, ...]

    def key(self) -> tuple:
        """What identifies the loaded kernel in the runtime's in-memory cache."""
        return (self.source, self.entry, self.args)


class CpuKernel:
    """A loaded CpuProgram: call it with the task's input and output tensors (contiguous)."""

    def __init__(self, program: CpuProgram):
        self.program = program
        self.path = build_shared_library(program.source, program.entry)
        self._lib = ctypes.CDLL(str(self.path))
        self._fn = getattr(self._lib, program.entry)
        self._fn.restype = None
        self._fn.argtypes = [ctypes.c_void_p] * len(program.args)

    def __call__(self, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> None:
        buffers = KernelArgs.bind(inputs, outputs)
        self._fn(*[buffers[name] for name in self.program.args])
