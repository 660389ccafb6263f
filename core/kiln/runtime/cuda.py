"""Building and launching CUDA kernels: NVRTC and the driver API, through cuda-python.

NVRTC compiles CUDA C++ to a cubin for one architecture (`sm_80`, `sm_90`, `sm_90a`), through
the kernel cache (the key covers the source, NVRTC's version, the options and the
architecture). Modules load with the driver API into PyTorch's primary context, and kernels
launch on PyTorch's current stream, so they order with PyTorch's own work.

cuda-python (`cuda-bindings`, with `nvidia-cuda-nvrtc`) is optional: without it, or without a
GPU, Kiln runs on the CPU, and `unavailable_reason()` says why CUDA cannot be used.
"""
from __future__ import annotations

import contextvars
import ctypes
import functools
import os
import re
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from kiln.codegen.emitter import KernelArgs
from kiln import dtypes, settings
from kiln.dtypes import DataType
from kiln.log import current_record
from kiln.runtime import dependent_launch
from kiln.runtime.cache import content_key, lookup_or_build
from kiln.table import numbered_source

BASE_OPTIONS = ("-std=c++17", "-default-device", "-diag-suppress=177")


@dataclass(frozen=True)
class Launch:
    """One kernel launch of a CudaProgram, its arguments named as in `KernelArgs`.

    Either `grid` is fixed, or the grid covers `items` work items at `per_block` per block,
    capped at `waves` blocks per multiprocessor (the kernel loops over what remains). With
    `narrows`, the items are warps that the kernel finds through blockDim (the auto-scheduler's
    warp mode): where fewer than two blocks a multiprocessor would cover them, blocks take fewer
    warps (two at least), so that the work spreads over every multiprocessor. With `cluster`
    > 1 the blocks launch in thread-block clusters of that many (consecutive blocks along x:
    block x is rank x % cluster of its cluster), the grid's x a multiple of it; a grid of items
    covers no more clusters than run at once.
    """

    kernel: str
    args: tuple   # buffer names (`KernelArgs`) and `TensorMapArg`s
    block: tuple[int, int, int]
    grid: tuple[int, int, int] | None = None
    items: int = 0
    per_block: int = 1
    waves: int = 16
    smem: int = 0
    narrows: bool = False
    cluster: int = 1

    @property
    def empty(self) -> bool:
        """Whether the launch has no work: a fixed grid with no blocks along some dimension, or
        no items to cover (a node with no elements). CUDA rejects a grid of no blocks, so the
        runtime makes no such launch."""
        return 0 in self.grid if self.grid is not None else self.items == 0

    def shape_for(self, sm_count: int,
                  max_clusters: int | None = None) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
        """The grid and the block to launch on a GPU with `sm_count` multiprocessors, where at
        most `max_clusters` of this launch's clusters fit at once (cluster launches: the grid
        then covers no more, so that a persistent kernel's blocks all run together)."""
        if self.grid is not None:
            return self.grid, self.block
        per_block, block = self.per_block, self.block
        if self.narrows:
            while per_block > 2 and -(-self.items // per_block) < 2 * sm_count:
                per_block //= 2
            block = (32 * per_block, 1, 1)
        blocks = min(-(-self.items // per_block), sm_count * self.waves)
        if self.cluster > 1:
            clusters = min(blocks // self.cluster, max_clusters or sm_count // self.cluster)
            return (self.cluster * max(1, clusters), 1, 1), block
        return (max(1, blocks), 1, 1), block


@dataclass
class CudaProgram:
    """What a CUDA schedule produces: one source, the kernels to launch in order, and the
    temporaries (shape, dtype) allocated from PyTorch's allocator for each run (`tmp0..`).

    `arch_suffix` 'a' asks for sm_90a-only features; `min_arch` is the lowest architecture it
    builds for. Inputs and outputs at addresses that are not multiples of `alignment` (a view at
    an odd offset, say) go through aligned copies. `sizes` are the values of the program's
    symbolic sizes (`kiln.codegen.sizes`): launch arguments `KernelArgs.size(k)`, int64s.
    `waiting` names kernels that wait for the grids before them themselves
    (`kiln.codegen.ptx.PRIOR_GRIDS`), after work that touches no global memory (L2 prefetches of
    their weights), where the runtime would otherwise make that wait their first statement
    (`kiln.runtime.dependent_launch`). `streaming` names kernels that let the next kernel launch
    right after their wait whatever their grid (memory-bound ones followed by memory-bound ones:
    see `kiln.runtime.dependent_launch`)."""

    source: str
    launches: list[Launch]
    temporaries: list[tuple[tuple[int, ...], DataType]] = field(default_factory=list)
    arch_suffix: str = ""
    min_arch: int = 80
    alignment: int = 1       # bytes every input and output pointer must be a multiple of
    sizes: tuple[int, ...] = ()
    waiting: tuple[str, ...] = ()
    streaming: tuple[str, ...] = ()

    @property
    def kernel_names(self) -> list[str]:
        return list(dict.fromkeys(launch.kernel for launch in self.launches))

    def key(self) -> tuple:
        """What identifies the loaded program in the runtime's in-memory cache."""
        return (self.source, tuple(self.launches), tuple(self.temporaries), self.arch_suffix, self.alignment,
                self.sizes, self.waiting, self.streaming)

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


_COMPILE_SLOTS = threading.BoundedSemaphore(len(os.sched_getaffinity(0)))
"""NVRTC compilations that run at once in this process, whatever the threads asking (graph
builds in parallel, each compiling candidates in parallel): one per usable core. More would only
share the cores, each holding its own memory (about 100 MB for a GEMM template's)."""


def _compile(source: str, name: str, arch: str, options: Sequence[str]) -> bytes:
    _, nvrtc = _bindings()
    prog = _check(nvrtc.nvrtcCreateProgram(source.encode(), f"{name}.cu".encode(), 0, [], []),
                  "nvrtcCreateProgram")
    try:
        opts = [o.encode() for o in (*options, f"--gpu-architecture={arch}")]
        with _COMPILE_SLOTS:
            status = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)[0]
        size = _check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
        log = bytearray(size)  # never `b" " * size`: at size 1 that is CPython's shared b" "
        nvrtc.nvrtcGetProgramLog(prog, log)
        if int(status) != 0:
            text = log.decode(errors="replace").rstrip("\x00 \n")
            raise CudaBuildError(f"NVRTC {nvrtc_version()} failed to compile kernel '{name}' for {arch}:\n"
                                 f"{text}\n--- source ---\n{numbered_source(source)}")
        size = _check(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
        cubin = bytearray(size)
        _check(nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        return bytes(cubin)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


_cubins: dict[tuple, Path] = {}
"""(process, kernel cache folder, content key) -> the cubin `compile_cubin` returned for it."""


def compile_cubin(source: str, name: str, arch: str, options: Sequence[str] = ()) -> Path:
    """Compile `source` for `arch` (e.g. 'sm_90') through the kernel cache; return the cubin's
    path. A source this process took from the same cache before is that cubin again, read from
    no entry (a new sequence length's programs are mostly the sources of the last one)."""
    options = (*BASE_OPTIONS, *options)
    key = content_key("cuda", source, "nvrtc", nvrtc_version(), " ".join(options), arch)
    taken = (os.getpid(), settings.current().cache_dir, key)
    cubin = _cubins.get(taken)
    if cubin is None or not cubin.exists():
        cubin = _cubins[taken] = lookup_or_build("cuda", key, ".cubin",
                                                 lambda out: out.write_bytes(_compile(source, name, arch, options)))
    else:
        current_record().add_cache_lookup("cuda", hit=True)
    return cubin


def launch_source(program: CudaProgram, arch: str) -> str:
    """The source the runtime compiles `program` from for a GPU of `arch` ('sm_90'): each
    kernel waiting for the grids before it where they launch as programmatic dependents
    (`kiln.runtime.dependent_launch`)."""
    if dependent_launch.enabled(arch_number(arch)):
        return _with_prior_grid_wait(program.source, program.waiting, program.streaming)
    return program.source


# a new sequence length's plan loads programs whose sources an earlier length's had: their
# edited sources are those again (an edit scans the whole source, a millisecond for a GEMM's)
_with_prior_grid_wait = functools.lru_cache(maxsize=256)(dependent_launch.with_prior_grid_wait)


def compile_many(jobs: Sequence[tuple[str, str, str]], workers: int | None = None) -> list[Path]:
    """Compile several (source, name, arch) jobs in parallel threads (NVRTC releases the GIL)."""
    if len(jobs) <= 1:
        return [compile_cubin(*job) for job in jobs]
    with ThreadPoolExecutor(max_workers=workers or min(16, len(jobs))) as pool:
        # each job in a copy of the caller's context, which holds the compile's record (kiln.log)
        futures = [pool.submit(contextvars.copy_context().run, compile_cubin, *job) for job in jobs]
        return [future.result() for future in futures]


# ------------------------------------------------------------------ devices and modules

_lock = threading.Lock()


@functools.lru_cache(maxsize=None)
def _context(index: int):
    """PyTorch's primary context of device `index`, made current in this thread."""
    reason = unavailable_reason()
    if reason:
        raise CudaError(f"CUDA is unavailable: {reason}")
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
    props = torch.cuda.get_device_properties(index)
    driver, _ = _bindings()
    _make_current(index)
    attr = driver.CUdevice_attribute
    dev = _check(driver.cuDeviceGet(index), "cuDeviceGet")
    smem = _check(driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, dev),
                  "cuDeviceGetAttribute")
    return {"name": props.name, "arch": f"sm_{props.major}{props.minor}",
            "sm_count": props.multi_processor_count, "max_smem": int(smem)}


@functools.lru_cache(maxsize=None)
def loads_kernels_in_capture() -> bool:
    """Whether the driver loads a kernel that is first launched inside a CUDA graph capture (CUDA
    12.3 and later): a capture then needs no run before it to load what it launches."""
    driver, _ = _bindings()
    return _check(driver.cuDriverGetVersion(), "cuDriverGetVersion") >= 12030


_modules: dict[tuple[str, int], object] = {}
"""(cubin path, device index) -> its module, loaded once a process (a cubin's path is its
content's key in the kernel cache: one path, one binary); guarded by `_lock`."""
_smem_allowed: dict[tuple[str, str, int], int] = {}
"""(cubin path, kernel, device index) -> the dynamic shared memory its function is allowed."""


def _module(cubin: Path, device_index: int):
    """The module of `cubin` on a device, loaded now where this process has not (under `_lock`,
    the device's context current)."""
    key = (str(cubin), device_index)
    module = _modules.get(key)
    if module is None:
        driver, _ = _bindings()
        module = _modules[key] = _check(driver.cuModuleLoadData(cubin.read_bytes()), "cuModuleLoadData")
    return module


class CudaKernel:
    """A kernel loaded from a cubin on one device; call `launch` with pointers and a grid."""

    def __init__(self, cubin: Path, name: str, device_index: int, dynamic_smem: int = 0, dependent: bool = False,
                 cluster: int = 1):
        """`dependent`: launch as a programmatic dependent of the kernel ahead of it in the
        stream (the kernel must wait for prior grids first: `kiln.runtime.dependent_launch`);
        `cluster`: launch in thread-block clusters of that many blocks along x."""
        driver, _ = _bindings()
        self.name = name
        self.device_index = device_index
        self._attrs = []
        self._configs = {}
        if dependent:
            attr = driver.CUlaunchAttribute()
            attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            attr.value.programmaticStreamSerializationAllowed = 1
            self._attrs.append(attr)
        if cluster > 1:
            attr = driver.CUlaunchAttribute()
            attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
            attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = cluster, 1, 1
            self._attrs.append(attr)
        self.cluster = cluster
        with _lock:
            _make_current(device_index)
            self._module = _module(cubin, device_index)
            self._fn = _check(driver.cuModuleGetFunction(self._module, name.encode()),
                              f"cuModuleGetFunction({name})")
            # the kernels of one module share its functions: the largest allowance stays
            function = (str(cubin), name, device_index)
            if dynamic_smem > _smem_allowed.get(function, 48 * 1024):
                attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
                _check(driver.cuFuncSetAttribute(self._fn, attr, dynamic_smem), "cuFuncSetAttribute")
                _smem_allowed[function] = dynamic_smem

    def launch(self, pointers: Sequence[int], grid: tuple[int, int, int], block: tuple[int, int, int],
               smem: int = 0, stream: int | None = None) -> None:
        """Launch on `stream` (PyTorch's current stream by default) with pointer arguments (ints)
        and by-value ones (bytes, such as a tensor map's 128)."""
        driver, _ = _bindings()
        if stream is None:
            stream = torch.cuda.current_stream(self.device_index).cuda_stream
        _make_current(self.device_index)
        values = [ctypes.create_string_buffer(p, len(p)) if isinstance(p, bytes) else ctypes.c_void_p(p)
                  for p in pointers]
        params = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
        if not self._attrs:
            _check(driver.cuLaunchKernel(self._fn, *grid, *block, smem, driver.CUstream(stream),
                                         ctypes.addressof(params), 0), f"cuLaunchKernel({self.name})")
            return
        config = self._config(grid, block, smem, stream)
        _check(driver.cuLaunchKernelEx(config, self._fn, ctypes.addressof(params), 0), f"cuLaunchKernelEx({self.name})")

    def _config(self, grid: tuple[int, int, int], block: tuple[int, int, int], smem: int, stream: int):
        """The `CUlaunchConfig` of a launch with this kernel's attributes, made once per shape and stream."""
        key = (grid, block, smem, stream)
        config = self._configs.get(key)
        if config is None:
            driver, _ = _bindings()
            config = driver.CUlaunchConfig()
            config.gridDimX, config.gridDimY, config.gridDimZ = grid
            config.blockDimX, config.blockDimY, config.blockDimZ = block
            config.sharedMemBytes = smem
            config.hStream = driver.CUstream(stream)
            config.attrs, config.numAttrs = self._attrs, len(self._attrs)
            self._configs[key] = config
        return config

    def max_active_clusters(self, block: tuple[int, int, int], smem: int) -> int:
        """How many of this kernel's clusters the GPU runs at once with `block` and `smem` bytes
        of dynamic shared memory (`cuOccupancyMaxActiveClusters`)."""
        driver, _ = _bindings()
        _make_current(self.device_index)
        config = self._config((self.cluster, 1, 1), block, smem, 0)
        return _check(driver.cuOccupancyMaxActiveClusters(self._fn, config), f"cuOccupancyMaxActiveClusters({self.name})")


class CudaRunner:
    """A CudaProgram compiled (through the kernel cache) and loaded on one device: call it with
    input and output tensors. Launches with no work (`Launch.empty`) are not made, and a
    program left with none compiles and loads nothing (its `cubin` is None)."""

    def __init__(self, program: CudaProgram, device_index: int, cubin: Path | None = None, build: bool = True):
        """Compile `program` for the device's architecture through the kernel cache, or load
        `cubin`, built from it before for that architecture (`kiln.load` passes one it saved);
        without `build`, a program that launches kernels and comes without its cubin is a
        ValueError (nothing is compiled)."""
        info = device_info(device_index)
        self.program = program
        self.device_index = device_index
        self.sm_count = info["sm_count"]
        self.launches = [launch for launch in program.launches if not launch.empty]
        self.kernels, self.shapes, self.cubin = {}, [], None
        if not self.launches:
            return
        if cubin is None and not build:
            raise ValueError(f"no cubin given for a program launching {self.launches[0].kernel}")
        arch = program.arch_for(info["arch"])
        self.cubin = cubin = cubin or compile_cubin(launch_source(program, arch), self.launches[0].kernel, arch)
        dependent = dependent_launch.enabled(arch_number(arch))
        smem, cluster = {}, {}
        for launch in self.launches:
            smem[launch.kernel] = max(smem.get(launch.kernel, 0), launch.smem)
            cluster[launch.kernel] = launch.cluster
        self.kernels = {name: CudaKernel(cubin, name, device_index, smem[name], dependent, cluster[name])
                        for name in smem}
        self.shapes = [launch.shape_for(self.sm_count, self.kernels[launch.kernel].max_active_clusters(
            launch.block, launch.smem) if launch.cluster > 1 and launch.grid is None else None)
            for launch in self.launches]

    def __call__(self, inputs: list, outputs: list) -> None:
        if not self.launches:
            return
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
        buffers.update({KernelArgs.size(k): struct.pack("<q", v) for k, v in enumerate(self.program.sizes)})
        stream = torch.cuda.current_stream(self.device_index).cuda_stream
        for launch, shape in zip(self.launches, self.shapes):
            self.kernels[launch.kernel].launch([resolve(a, buffers) for a in launch.args], *shape, launch.smem, stream)


# ------------------------------------------------------------------ TMA tensor maps
# TMA tensor maps: the 128-byte descriptors Hopper's bulk tensor copies read, made on the host.
# 
# A kernel that loads tiles with `cp.async.bulk.tensor` takes a `const __grid_constant__
# CUtensorMap` parameter by value. A launch names it with a `TensorMapArg` among its pointer
# arguments (``Launch.args``): the buffer it describes, the dimensions and
# strides (in elements, innermost first) and the box one copy moves. `encode` turns it into the
# descriptor's bytes for the buffer's address through the driver (`cuTensorMapEncodeTiled`),
# cached per (address, map), so a graph that runs again on the same buffers encodes nothing.
TENSOR_MAP_BYTES = 128
_CACHE_LIMIT = 4096


@dataclass(frozen=True)
class TensorMapArg:
    """A tensor-map kernel argument over buffer `param` ('in0', ...) from element `offset` on
    (a multiple of 16 bytes): `dims` and `strides` in elements, innermost first (strides[0]
    must be 1), `box` the tile one copy loads, with 128-byte swizzling (box[0] * element bytes
    must then be 128 at most)."""

    param: str
    dtype: DataType
    dims: tuple[int, ...]
    strides: tuple[int, ...]
    box: tuple[int, ...]
    swizzle: int = 128
    offset: int = 0

    def __post_init__(self):
        rank = len(self.dims)
        if not (1 <= rank <= 5 and len(self.strides) == rank and len(self.box) == rank):
            raise ValueError(f"tensor map over {self.param}: rank {rank} (dims {self.dims}, strides "
                             f"{self.strides}, box {self.box}); TMA takes ranks 1 to 5 with one stride and box per dim")
        if self.strides[0] != 1 or any(s * self.dtype.nbytes % 16 for s in self.strides[1:]):
            raise ValueError(f"tensor map over {self.param}: strides {self.strides} (elements of "
                             f"{self.dtype.nbytes} bytes); TMA needs unit innermost stride and others multiples of 16 bytes")
        if self.offset < 0 or self.offset * self.dtype.nbytes % 16:
            raise ValueError(f"tensor map over {self.param}: offset {self.offset} (elements of {self.dtype.nbytes} "
                             "bytes); TMA needs a start address that is a multiple of 16 bytes")
        inner = self.box[0] * self.dtype.nbytes
        if any(not 1 <= b <= 256 for b in self.box) or (inner > self.swizzle if self.swizzle else inner % 16):
            raise ValueError(f"tensor map over {self.param}: box {self.box}; each box dim must be 1..256 and the "
                             + (f"inner one at most {self.swizzle} bytes" if self.swizzle else
                                "inner one a multiple of 16 bytes"))


_DATA_TYPES = {dtypes.float16: "FLOAT16", dtypes.bfloat16: "BFLOAT16", dtypes.float32: "FLOAT32"}
_tensor_map_lock = threading.Lock()
_tensor_maps: dict[tuple, bytes] = {}


def encode(arg: TensorMapArg, address: int) -> bytes:
    """The 128 bytes of `arg`'s tensor map for the buffer at device `address` (16-byte aligned)."""
    key = (arg, address)
    found = _tensor_maps.get(key)
    if found is not None:
        return found
    driver, _ = _bindings()
    address += arg.offset * arg.dtype.nbytes
    if address % 16:
        raise ValueError(f"tensor map over {arg.param}: address {address:#x} is not 16-byte aligned")
    names = getattr(driver.CUtensorMapDataType, f"CU_TENSOR_MAP_DATA_TYPE_{_DATA_TYPES[arg.dtype]}")
    swizzle = {128: "CU_TENSOR_MAP_SWIZZLE_128B", 64: "CU_TENSOR_MAP_SWIZZLE_64B",
               32: "CU_TENSOR_MAP_SWIZZLE_32B", 0: "CU_TENSOR_MAP_SWIZZLE_NONE"}[arg.swizzle]
    size = arg.dtype.nbytes
    tensor_map = _check(driver.cuTensorMapEncodeTiled(
        names, len(arg.dims), address, [driver.cuuint64_t(d) for d in arg.dims],
        [driver.cuuint64_t(s * size) for s in arg.strides[1:]], [driver.cuuint32_t(b) for b in arg.box],
        [driver.cuuint32_t(1)] * len(arg.dims), driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        getattr(driver.CUtensorMapSwizzle, swizzle),
        driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE),
        f"cuTensorMapEncodeTiled({arg.param}: dims {arg.dims}, strides {arg.strides}, box {arg.box})")
    raw = ctypes.string_at(tensor_map.getPtr(), TENSOR_MAP_BYTES)
    with _tensor_map_lock:
        if len(_tensor_maps) >= _CACHE_LIMIT:
            _tensor_maps.clear()
        _tensor_maps[key] = raw
    return raw


def resolve(arg, buffers: dict[str, int | bytes]):
    """A launch argument's value: a buffer's address (or a size's bytes), or a tensor map's
    bytes over its buffer."""
    if isinstance(arg, TensorMapArg):
        return encode(arg, buffers[arg.param])
    return buffers[arg]
