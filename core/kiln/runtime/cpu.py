"""Building and loading CPU kernels: the system C compiler and ctypes."""
from __future__ import annotations

import ctypes
import functools
import os
import platform
import shutil
import subprocess
import threading
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch.utils.weak import WeakIdKeyDictionary

from kiln.codegen.emitter import KernelArgs
from kiln.log import current_record
from kiln.runtime.cache import content_key, lookup_or_build
from kiln.runtime.kernel_errors import KernelCheck, raise_failed
from kiln.settings import current
from kiln.table import numbered_source

# -fno-tree-loop-if-convert: GCC 12.2 at -O3 with AVX2 or AVX-512 vectorizes a loop whose
# load sits in one branch of an if (a Select guarding a load) with masked loads that read the
# wrong elements; tests/test_silent_wrong.py::test_a_load_under_a_condition_in_a_vectorized_loop
# shows it on `where(abs(x) > t, x, 0)` fused over 16 x 16.
FLAGS = ["-O3", "-std=gnu11", "-fPIC", "-shared", "-fopenmp", "-fwrapv", "-fno-math-errno",
         "-fno-tree-loop-if-convert", "-march=native"]


class BuildError(RuntimeError):
    """A kernel failed to compile; the message holds the compiler's log and the source."""


@functools.lru_cache(maxsize=None)
def compiler() -> tuple[str, str, str]:
    """(path, version, target architecture) of the C compiler; $CC overrides."""
    cc = current().c_compiler or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise BuildError("Kiln's CPU backend needs a C compiler: install gcc (or set $CC)")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    arch = subprocess.run([cc, "-march=native", "-Q", "--help=target"], capture_output=True, text=True).stdout
    march = next((ln.split()[-1] for ln in arch.splitlines() if ln.strip().startswith("-march=")), "")
    return cc, version, f"{platform.machine()}-{march}-{cpu_model()}"


@functools.lru_cache(maxsize=None)
def cpu_model() -> str:
    """The host CPU's model name and a hash of its feature flags (from /proc/cpuinfo where
    there is one), so that the kernel cache never serves code built for another CPU."""
    try:
        info = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or "unknown-cpu"
    fields = {}
    for line in info:
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return f"{fields.get('model name', 'unknown-cpu')}/{content_key(fields.get('flags', ''))[:16]}"


def architecture() -> str:
    """The processor kernels built here are for, as saved models record it: the machine type
    and `cpu_model()` (what the kernel cache tells processors apart by; no compiler needed)."""
    return f"{platform.machine()} {cpu_model()}"


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
                             f"{numbered_source(source)}")

    return lookup_or_build("cpu", key, ".so", build)


@dataclass(frozen=True)
class Preparation:
    """How a program takes one of its inputs laid out once, where that input is a constant of
    the graph (a weight packed into the panels its GEMM reads).

    `function` is a C function of the program, `int64_t function(<the kernel's parameters: its
    buffers, then its sizes>, float* dst)`: it reads input number `input` alone (every other
    buffer is NULL), writes the prepared form, float32, to `dst` (64-byte aligned) unless `dst`
    is NULL, and returns its number of elements; the form must not depend on the sizes' values
    (one serves every size of a symbolic kernel). `entry` is a kernel of the same program whose
    parameters are the buffers `args` (the plain kernel's, and the prepared form as one more
    input, `KernelArgs.input(number of inputs)`), then the sizes."""

    input: int
    function: str
    entry: str
    args: tuple[str, ...]


@dataclass(frozen=True)
class CpuProgram:
    """What a CPU schedule produces: C `source` defining `void entry(...)`, whose parameters
    are pointers to the buffers named by `args` in order (kernel argument names of
    `kiln.codegen.emitter.KernelArgs`: the task's inputs, then its outputs, then
    `KernelArgs.STATUS` where the kernel reports failed `checks`), then an int64 for each of
    `sizes`, the values of its symbolic sizes (`kiln.codegen.sizes`) it is called with. A
    program may also take a constant input laid out once (`preparation`)."""

    source: str
    entry: str
    args: tuple[str, ...]
    checks: tuple[KernelCheck, ...] = ()
    sizes: tuple[int, ...] = ()
    preparation: Preparation | None = None

    def key(self) -> tuple:
        """What identifies the loaded kernel in the runtime's in-memory cache (the checks'
        messages and the sizes are not in the source)."""
        return (self.source, self.entry, self.args, self.checks, self.sizes, self.preparation)


_omp_threads = threading.local()
# prepared forms by source tensor, then (library, function): (the source's state then, the form)
_prepared = WeakIdKeyDictionary()
_prepared_lock = threading.Lock()


_libraries: dict[tuple, tuple[Path, ctypes.CDLL]] = {}
"""(process, kernel cache folder, C source) -> the library `_library` loaded for it."""
_libraries_lock = threading.Lock()


def _library(source: str, name: str) -> tuple[Path, ctypes.CDLL]:
    """The shared library of C `source`, built or found through the kernel cache and loaded at
    its first use in this process with this cache; later kernels of the same source (a
    symbolic kernel's other sizes) share it without reading the cache again (as
    `kiln.runtime.cuda.compile_cubin` takes a cubin once)."""
    key = (os.getpid(), current().cache_dir, source)
    with _libraries_lock:
        found = _libraries.get(key)
    if found is not None:
        current_record().add_cache_lookup("cpu", hit=True)
        return found
    path = build_shared_library(source, name)
    found = (path, ctypes.CDLL(str(path)))
    with _libraries_lock:
        return _libraries.setdefault(key, found)


@functools.lru_cache(maxsize=None)
def _libgomp() -> ctypes.CDLL:
    """The OpenMP runtime the kernels link (-fopenmp), loaded by its soname: the same instance."""
    return ctypes.CDLL("libgomp.so.1")


class CpuKernel:
    """A loaded CpuProgram: call it with the task's input and output tensors (contiguous). Its
    OpenMP regions use torch.get_num_threads() threads; a check that fails in its status
    buffer raises its exception (see `kiln.runtime.kernel_errors`)."""

    def __init__(self, program: CpuProgram, library: Path | None = None):
        """Build `program` through the kernel cache, or load it from `library`, a shared object
        built from it before (`kiln.load` passes one it saved; it may be deleted once loaded)."""
        self.program = program
        if library is None:
            self.path, self._lib = _library(program.source, program.entry)
        else:
            self.path, self._lib = library, ctypes.CDLL(str(library))
        self._fn = getattr(self._lib, program.entry)
        self._fn.restype = None
        self._fn.argtypes = [ctypes.c_void_p] * len(program.args) + [ctypes.c_int64] * len(program.sizes)
        self._positions: dict[tuple[int, int], tuple[int, ...]] = {}    # by (inputs, outputs) given
        self._reports = KernelArgs.STATUS in program.args

    def prepare(self, constants: list[torch.Tensor | None],
                threads: int | None = None) -> tuple[CpuKernel, torch.Tensor] | None:
        """Where the program prepares an input (`CpuProgram.preparation`) and `constants` (one
        per input, None for those that are not constants) gives it: the kernel that reads the
        prepared form as one more input, and that form: computed now (by `threads` OpenMP
        threads, torch's number by default), or the one computed before from the same tensor
        with the same memory, layout and version by the same library's function (the graphs of
        a model traced at several sizes share it)."""
        p = self.program.preparation
        if p is None or constants[p.input] is None:
            return None
        source, key = constants[p.input], (str(self.path), p.function)
        state = (source.data_ptr(), source._version, tuple(source.shape), source.stride(), source.dtype)
        with _prepared_lock:
            seen, prepared = _prepared.get(source, {}).get(key, (None, None))
        if seen != state:
            prepared = self._run_preparation(p, source.contiguous(), threads)
            with _prepared_lock:
                _prepared.setdefault(source, {})[key] = (state, prepared)
        kernel = replace(self.program, entry=p.entry, args=p.args, preparation=None)
        return CpuKernel(kernel, self.path), prepared

    def _run_preparation(self, p: Preparation, source: torch.Tensor, threads: int | None) -> torch.Tensor:
        fn = getattr(self._lib, p.function)
        fn.restype = ctypes.c_int64
        fn.argtypes = ([ctypes.c_void_p] * len(self.program.args) + [ctypes.c_int64] * len(self.program.sizes)
                       + [ctypes.c_void_p])
        buffers = {KernelArgs.input(p.input): source.data_ptr()}
        call = lambda dst: fn(*[buffers.get(name) for name in self.program.args], *self.program.sizes, dst)
        prepared = torch.empty(call(None), dtype=torch.float32)
        if prepared.data_ptr() % 64:      # torch's CPU allocator aligns to 64: the layouts store whole vectors
            raise RuntimeError(f"kernel '{self.program.entry}': a prepared form needs 64-byte aligned memory, "
                               f"torch allocated it at {prepared.data_ptr():#x}")
        self._threads(threads)
        call(prepared.data_ptr())
        return prepared

    @staticmethod
    def _threads(threads: int | None = None) -> None:
        threads = torch.get_num_threads() if threads is None else threads
        if getattr(_omp_threads, "count", None) != threads:
            _libgomp().omp_set_num_threads(threads)
            _omp_threads.count = threads

    def __call__(self, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> None:
        self._threads()
        arity = (len(inputs), len(outputs))
        positions = self._positions.get(arity)
        if positions is None:
            positions = self._positions[arity] = KernelArgs.positions(self.program.args, *arity)
        tensors = [*inputs, *outputs]
        if not self._reports:     # the common case, a step of every model: no status buffer to make
            self._fn(*[tensors[k].data_ptr() for k in positions], *self.program.sizes)
            return
        status = (ctypes.c_int64 * 2)()
        self._fn(*[tensors[k].data_ptr() if k >= 0 else ctypes.addressof(status) for k in positions],
                 *self.program.sizes)
        if status[0]:
            raise_failed(self.program.checks, status[0], status[1], self.program.entry)
