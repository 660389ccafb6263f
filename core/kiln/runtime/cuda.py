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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Sequence

from kiln.runtime.cache import content_key, lookup_or_build

BASE_OPTIONS = ("-std=c++17", "-default-device", "-diag-suppress=177")


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
        """Launch on `stream` (PyTorch's current stream by default) with pointer arguments (ints)
        and by-value ones (bytes, such as a tensor map's 128)."""
        import torch
        driver, _ = _bindings()
        if stream is None:
            stream = torch.cuda.current_stream(self.device_index).cuda_stream
        _make_current(self.device_index)
        values = [ctypes.create_string_buffer(p, len(p)) if isinstance(p, bytes) else ctypes.c_void_p(p)
                  for p in pointers]
        params = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
        _check(driver.cuLaunchKernel(self._fn, *grid, *block, smem, driver.CUstream(stream),
                                     ctypes.addressof(params), 0), f"cuLaunchKernel({self.name})")
