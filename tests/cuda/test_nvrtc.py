"""CI without a GPU: every CUDA program Kiln would build for the representative operator calls
(auto-scheduled, and each template's tuning space at level 1) compiles with NVRTC for sm_80
and sm_90. Needs cuda-bindings and nvidia-cuda-nvrtc (the README's test command installs them).

For full coverage, run any CPU tests with `KILN_NVRTC_CHECK=sm_80,sm_90`: every task the CPU
backend builds then has its CUDA program compiled too (see `kiln.schedule.choose.build_task`).
"""
import os
import threading
import time

import pytest

from kiln.log import recording
from kiln.plugins.registry import registry
from kiln.runtime import cuda as rt

from tests.cuda.cases import CASES

pytestmark = pytest.mark.skipif(not rt.nvrtc_available(),
                                reason="cuda-bindings / nvidia-cuda-nvrtc not installed: "
                                       "pip install 'kiln-core[cuda]'")

ARCHS = ("sm_80", "sm_90")


def _operator_task(op, *args, **kwargs):
    definition = registry().operator(op)
    return definition.task(definition.bind(args, kwargs))[0]


def _task(case, dtype):
    args, kwargs = case.make(dtype, "cpu")
    return _operator_task(case.op, *args, **kwargs)


PARAMS = [pytest.param(c, d, id=f"{c.name}-{str(d).replace('torch.', '')}") for c in CASES for d in c.dtypes]


@pytest.mark.parametrize("case,dtype", PARAMS)
def test_compiles_for_sm80_and_sm90(case, dtype):
    from kiln.schedule.choose import check_nvrtc
    check_nvrtc(_task(case, dtype), ARCHS)


def test_check_compiles_each_code_path_once_not_once_a_size(monkeypatch):
    """KILN_NVRTC_CHECK over a test suite: every knob setting is compiled for an operator and
    its dtypes; at other sizes only the programs built by default (each template's level-0
    setting, the auto-scheduler's) are compiled again, and only where their code changes."""
    import importlib
    import torch
    choose = importlib.import_module("kiln.schedule.choose")   # the package exports the function
    compiled = []
    monkeypatch.setattr(choose, "_COMPILED", set())
    monkeypatch.setattr(rt, "compile_many", lambda jobs: compiled.extend(jobs))

    def checked(*shapes, dtype=torch.float32):
        compiled.clear()
        task = _operator_task("matmul", *(torch.randn(s, dtype=dtype) for s in shapes))
        choose.check_nvrtc(task, ARCHS)
        defaults = len(ARCHS) * (len(choose.schedules_for(task, "cuda")) + 1)
        return len(compiled), defaults

    first, defaults = checked((64, 96), (96, 128))
    assert first > defaults and {arch for *_, arch in compiled} >= {"sm_80", "sm_90"}
    assert checked((64, 96), (96, 128))[0] == 0
    assert checked((64, 96), (96, 256))[0] == 0, "the same code at another size is compiled again"
    again, defaults = checked((63, 95), (95, 127))
    assert 0 < again <= defaults, "odd sizes change the default programs' code, and only theirs is compiled"
    assert checked((64, 96), (96, 128), dtype=torch.float16)[0] > defaults, "a new dtype compiles every setting"


def test_program_form_blanks_sizes_but_not_instructions():
    from kiln.schedule.choose import program_form
    a = "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 {...}; x[i * 768LL + 3] = v;"
    assert program_form(a) == program_form(a.replace("768LL", "1024LL").replace("+ 3", "+ 5"))
    assert program_form(a) != program_form(a.replace("n256", "n128"))
    assert program_form("float4 v;") != program_form("float2 v;")


def test_compile_error_shows_numbered_source():
    with pytest.raises(rt.CudaBuildError) as info:
        rt.compile_cubin('extern "C" __global__ void k() {\n  undeclared_thing = 1;\n}\n', "broken", "sm_80")
    message = str(info.value)
    assert "undeclared_thing" in message and "\n2 |   undeclared_thing = 1;" in message


def test_a_source_compiled_before_is_its_cubin_again(tmp_path, monkeypatch):
    """A new sequence length's programs are mostly the sources of the last one: the second ask
    for a source is the first's cubin, counted as a cache hit, with no look into the cache's
    entries; another cache folder looks into its own."""
    looked = []
    lookup = rt.lookup_or_build
    monkeypatch.setattr(rt, "lookup_or_build", lambda *args: looked.append(args[1]) or lookup(*args))
    source = 'extern "C" __global__ void k(float* x) { x[threadIdx.x] += 1.0f; }\n'
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "a"))
    with recording() as first:
        cubin = rt.compile_cubin(source, "k", "sm_80")
    with recording() as again:
        assert rt.compile_cubin(source, "k", "sm_80") == cubin and cubin.read_bytes()
    assert len(looked) == 1 and first.kernel_cache["cuda"]["misses"] == 1 and again.kernel_cache["cuda"]["hits"] == 1
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "b"))
    assert rt.compile_cubin(source, "k", "sm_80") != cubin and len(looked) == 2


def test_compiling_leaves_python_singletons_intact(tmp_path, monkeypatch):
    """NVRTC writes its (here empty, one-byte) log into the buffer it is given: a buffer that
    is CPython's shared one-byte object would turn every later space into a NUL."""
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    rt.compile_cubin('extern "C" __global__ void k() {}\n', "empty_log", "sm_80")
    assert b" " == bytes([32]) and " ".encode() == bytes([32])


def test_compilations_at_once_are_one_per_core(tmp_path, monkeypatch):
    """However many threads ask at once (a graph's kernels built in parallel, each compiling its
    candidates in parallel: dozens of threads), one NVRTC compilation runs per usable core, each
    holding its own memory (about 100 MB for a GEMM template's)."""
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    _, nvrtc = rt._bindings()
    compile_program, lock = nvrtc.nvrtcCompileProgram, threading.Lock()
    running, most = 0, 0

    def counted(*args):
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        try:
            time.sleep(0.05)      # long enough for every thread to be asking at once
            return compile_program(*args)
        finally:
            with lock:
                running -= 1

    monkeypatch.setattr(nvrtc, "nvrtcCompileProgram", counted)
    jobs = [(f'extern "C" __global__ void k{i}(float* x) {{ x[threadIdx.x] = {i}.0f; }}\n', f"k{i}", "sm_80")
            for i in range(12)]
    rt.compile_many(jobs, workers=len(jobs))
    assert most == min(len(jobs), len(os.sched_getaffinity(0)))


@pytest.mark.parametrize("size, channels", [(14, 672), (7, 2048), (7, 1280)])
def test_a_channels_last_global_average_pool_compiles(size, channels):
    """MobileNetV3's pooling of channels-last data (strides size * channels and channels of one
    reduction) crashed NVRTC 13.0 and 13.5 inside NVVM while the reduction's axes were
    unravelled with `%` and `/` (the process died: a segmentation fault, on the H100 too)."""
    import kiln
    from kiln.schedule.choose import check_nvrtc
    x = kiln.symbol([1, size, size, channels], "float16", "cuda")
    pooled = kiln.ops.adaptive_avg_pool2d(kiln.ops.permute(x, (0, 3, 1, 2)), 1)
    for node in kiln.graph.optimize(kiln.trace_from(pooled, [x])).nodes:
        check_nvrtc(node.task, ARCHS)
