"""Building and launching CUDA kernels: NVRTC and the driver API, through cuda-python.

NVRTC compiles CUDA C++ to a cubin for one architecture (`sm_80`, `sm_90`, `sm_90a`), through
the kernel cache (the key covers the source, NVRTC's version, the options and the
architecture). Modules load with the driver API into PyTorch's primary context, and kernels
launch on PyTorch's current stream, so they order with PyTorch's own work.

cuda-python (`cuda-bindings`, with `nvidia-cuda-nvrtc`) is optional: without it, or without a
GPU, Kiln runs on the CPU, and `unavailable_reason()` says why CUDA cannot be used.
"""
from __future__ import annotations

import ctypes
import functools
import threading
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from kiln.codegen.emitter import KernelArgs
from kiln.dtypes import DataType
from kiln.runtime.cache import content_key, lookup_or_build

BASE_OPTIONS = ("-std=c++17", "-default-device", "-diag-suppress=177")


@dataclass(frozen=True)
class Launch:
    """One kernel launch of a CudaProgram, its arguments named as in `KernelArgs`.

    Either `grid` is fixed, or the grid covers `items` work items at `per_block` per block,
    capped at `waves` blocks per multiprocessor (the kernel loops over what remains).
    """

    kernel: str
    args: tuple[str, ...]
    block: tuple[int, int, int]
    grid: tuple[int, int, int] | None = None
    items: int = 0
    per_block: int = 1
    waves: int = 16
    smem: int = 0

    def grid_for(self, sm_count: int) -> tuple[int, int, int]:
        """The grid to launch on a GPU with `sm_count` multiprocessors."""
        if self.grid is not None:
            return self.grid
        blocks = -(-self.items // self.per_block)
        return (max(1, min(blocks, sm_count * self.waves)), 1, 1)


@dataclass
class CudaProgram:
    """What a CUDA schedule produces: one source, the kernels to launch in order, and the
    temporaries (shape, dtype) allocated from PyTorch's allocator for each run (`tmp0..`).

    `arch_suffix` 'a' asks for sm_90a-only features; `min_arch` is the lowest architecture it
    builds for. Inputs and outputs at addresses that are not multiples of `alignment` (a view at
    an odd offset, say) go through aligned copies."""

    source: str
    launches: list[Launch]
    temporaries: list[tuple[tuple[int, ...], DataType]] = field(default_factory=list)
    arch_suffix: str = ""
    min_arch: int = 80
    alignment: int = 1       # bytes every input and output pointer must be a multiple of

    @property
    def kernel_names(self) -> list[str]:
        return list(dict.fromkeys(launch.kernel for launch in self.launches))

    def key(self) -> tuple:
        """What identifies the loaded program in the runtime's in-memory cache."""
        return (self.source, tuple(self.launches), tuple(self.temporaries), self.arch_suffix, self.alignment)

    def arch_for(self, device_arch: str) -> str:
        """The NVRTC architecture to build for on a device of `device_arch` ('sm_90')."""
        return device_arch + self.arch_suffix


def arch_number(arch: str) -> int:
    """The compute capability of an architecture name as a number: 'sm_90' and 'sm_90a' are
    90, 'sm_100' is 100."""
    found = re.fullmatch(r"sm_(\d{2,3})[af]?", arch.strip())
    if found is None:
        raise ValueError(f"not a CUDA architecture name: {arch!r} (expected e.g. 'sm_80', 'sm_90a', 'sm_100')")
    return int(found.group(1))


class CudaError(RuntimeError):
    """CUDA is unavailable, or a driver call failed."""


class CudaBuildError(CudaError):
    """NVRTC rejected a kernel; the message holds its log and the numbered source."""


def _bindings():
    try:
        from cuda.bindings import driver, nvrtc
    except ImportError as exc:
        raise CudaError(
            "Kiln's CUDA backend needs cuda-python: `pip install 'kiln-core[cuda]'` (installs "
            f"cuda-bindings and nvidia-cuda-nvrtc); import failed with: {exc}") from None
    return driver, nvrtc


def nvrtc_available() -> bool:
    """Whether NVRTC can compile kernels here (no GPU needed)."""
    try:
        nvrtc_version()
        return True
    except CudaError:
        return False


def unavailable_reason() -> str | None:
    """None when Kiln can run kernels on a CUDA GPU here, else the reason it cannot."""
    try:
        _bindings()
        nvrtc_version()
    except CudaError as exc:
        return str(exc)
    import torch
    if not torch.cuda.is_available():
        return ("no CUDA GPU is visible to PyTorch (torch.cuda.is_available() is False; "
                f"torch {torch.__version__}, built for CUDA {torch.version.cuda})")
    return None


def _check(result, what: str):
    """Unpack a cuda-python result tuple, raising CudaError on a failing status."""
    status, *rest = result if isinstance(result, tuple) else (result,)
    if int(status) != 0:
        name = getattr(status, "name", str(status))
        raise CudaError(f"{what} failed: {name}")
    return rest[0] if len(rest) == 1 else (tuple(rest) if rest else None)


@functools.lru_cache(maxsize=None)
def nvrtc_version() -> str:
    """NVRTC's version as 'major.minor'."""
    _, nvrtc = _bindings()
    try:
        major, minor = _check(nvrtc.nvrtcVersion(), "nvrtcVersion")
    except (RuntimeError, OSError) as exc:
        raise CudaError(f"the NVRTC library could not be loaded ({exc}); install nvidia-cuda-nvrtc") from None
    return f"{major}.{minor}"


def _numbered(source: str) -> str:
    return "\n".join(f"{n:5d} | {line}" for n, line in enumerate(source.splitlines(), 1))


def _compile(source: str, name: str, arch: str, options: Sequence[str]) -> bytes:
    _, nvrtc = _bindings()
    prog = _check(nvrtc.nvrtcCreateProgram(source.encode(), f"{name}.cu".encode(), 0, [], []),
                  "nvrtcCreateProgram")
    try:
        opts = [o.encode() for o in (*options, f"--gpu-architecture={arch}")]
        status = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)[0]
        size = _check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
        log = bytearray(size)  # never `b" " * size`: at size 1 that is CPython's shared b" "
        nvrtc.nvrtcGetProgramLog(prog, log)
        if int(status) != 0:
            text = log.decode(errors="replace").rstrip("\x00 \n")
            raise CudaBuildError(f"NVRTC {nvrtc_version()} failed to compile kernel '{name}' for {arch}:\n"
                                 f"{text}\n--- source ---\n{_numbered(source)}")
        size = _check(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
        cubin = bytearray(size)
        _check(nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        return bytes(cubin)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def compile_cubin(source: str, name: str, arch: str, options: Sequence[str] = ()) -> Path:
    """Compile `source` for `arch` (e.g. 'sm_90') through the kernel cache; return the cubin's path."""
    options = (*BASE_OPTIONS, *options)
    key = content_key("cuda", source, "nvrtc", nvrtc_version(), " ".join(options), arch)
    return lookup_or_build("cuda", key, ".cubin",
                           lambda out: out.write_bytes(_compile(source, name, arch, options)))


def compile_many(jobs: Sequence[tuple[str, str, str]], workers: int | None = None) -> list[Path]:
    """Compile several (source, name, arch) jobs in parallel threads (NVRTC releases the GIL)."""
    if len(jobs) <= 1:
        return [compile_cubin(*job) for job in jobs]
    with ThreadPoolExecutor(max_workers=workers or min(16, len(jobs))) as pool:
        return list(pool.map(lambda job: compile_cubin(*job), jobs))


# ------------------------------------------------------------------ devices and modules

_lock = threading.Lock()


@functools.lru_cache(maxsize=None)
def _context(index: int):
    """PyTorch's primary context of device `index`, made current in this thread."""
    reason = unavailable_reason()
    if reason:
        raise CudaError(f"CUDA is unavailable: {reason}")
    import torch
    driver, _ = _bindings()
    torch.cuda.init()
    with torch.cuda.device(index):
        torch.empty(1, device=f"cuda:{index}")   # makes torch create its primary context
    _check(driver.cuInit(0), "cuInit")
    dev = _check(driver.cuDeviceGet(index), "cuDeviceGet")
    ctx = _check(driver.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
    return ctx


def _make_current(index: int) -> None:
    driver, _ = _bindings()
    ctx = _context(index)
    current = _check(driver.cuCtxGetCurrent(), "cuCtxGetCurrent")
    if int(current) != int(ctx):
        _check(driver.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


@functools.lru_cache(maxsize=None)
def device_info(index: int) -> dict:
    """Name, architecture, multiprocessor count and shared-memory limit of a GPU."""
    import torch
    props = torch.cuda.get_device_properties(index)
    driver, _ = _bindings()
    _make_current(index)
    attr = driver.CUdevice_attribute
    dev = _check(driver.cuDeviceGet(index), "cuDeviceGet")
    smem = _check(driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, dev),
                  "cuDeviceGetAttribute")
    return {"name": props.name, "arch": f"sm_{props.major}{props.minor}",
            "sm_count": props.multi_processor_count, "max_smem": int(smem)}


class CudaKernel:
    """A kernel loaded from a cubin on one device; call `launch` with pointers and a grid."""

    def __init__(self, cubin: Path, name: str, device_index: int, dynamic_smem: int = 0):
        driver, _ = _bindings()
        self.name = name
        self.device_index = device_index
        with _lock:
            _make_current(device_index)
            self._module = _check(driver.cuModuleLoadData(cubin.read_bytes()), "cuModuleLoadData")
            self._fn = _check(driver.cuModuleGetFunction(self._module, name.encode()),
                              f"cuModuleGetFunction({name})")
        if dynamic_smem > 48 * 1024:
            attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            _check(driver.cuFuncSetAttribute(self._fn, attr, dynamic_smem), "cuFuncSetAttribute")

    def launch(self, pointers: Sequence[int], grid: tuple[int, int, int], block: tuple[int, int, int],
               smem: int = 0, stream: int | None = None) -> None:
        """Launch with pointer arguments on `stream` (PyTorch's current stream by default)."""
        import torch
        driver, _ = _bindings()
        if stream is None:
            stream = torch.cuda.current_stream(self.device_index).cuda_stream
        _make_current(self.device_index)
        values = (ctypes.c_void_p * len(pointers))(*pointers)
        params = (ctypes.c_void_p * len(pointers))(
            *[ctypes.addressof(values) + k * ctypes.sizeof(ctypes.c_void_p) for k in range(len(pointers))])
        _check(driver.cuLaunchKernel(self._fn, *grid, *block, smem, driver.CUstream(stream),
                                     ctypes.addressof(params), 0), f"cuLaunchKernel({self.name})")


class CudaRunner:
    """A CudaProgram compiled (through the kernel cache) and loaded on one device: call it with
    input and output tensors."""

    def __init__(self, program: CudaProgram, device_index: int):
        info = device_info(device_index)
        self.program = program
        self.device_index = device_index
        self.sm_count = info["sm_count"]
        cubin = compile_cubin(program.source, program.kernel_names[0], program.arch_for(info["arch"]))
        smem = {}
        for launch in program.launches:
            smem[launch.kernel] = max(smem.get(launch.kernel, 0), launch.smem)
        self.kernels = {name: CudaKernel(cubin, name, device_index, smem[name]) for name in program.kernel_names}

    def __call__(self, inputs: list, outputs: list) -> None:
        import torch
        align = self.program.alignment
        if align > 1 and any(t.data_ptr() % align for t in outputs):
            staged = [torch.empty_like(t) for t in outputs]
            self(inputs, staged)
            for dst, src in zip(outputs, staged):
                dst.copy_(src)
            return
        inputs = [t.clone() if t.data_ptr() % align else t for t in inputs]
        temps = [torch.empty(shape, dtype=t.torch_dtype, device=f"cuda:{self.device_index}")
                 for shape, t in self.program.temporaries]
        buffers = KernelArgs.bind(inputs, outputs, temps)
        stream = torch.cuda.current_stream(self.device_index).cuda_stream
        for launch in self.program.launches:
            self.kernels[launch.kernel].launch([buffers[a] for a in launch.args], launch.grid_for(self.sm_count),
                                               launch.block, launch.smem, stream)
