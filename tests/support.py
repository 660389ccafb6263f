"""Helpers shared by the tests: random inputs and comparison with PyTorch."""
from __future__ import annotations

import contextlib

import torch

import kiln

FLOAT_TOL = {
    torch.float64: (1e-9, 1e-9),
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


def rand(shape, dtype=torch.float32, low=-3, high=3, nonzero=False, generator=None):
    """Fresh random values of any dtype (never all zeros); `nonzero` avoids zeros entirely."""
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    if dtype.is_floating_point:
        t = torch.empty(shape, dtype=torch.float32).uniform_(low, high, generator=generator)
        if nonzero:
            t = torch.where(t.abs() < 0.1, torch.full_like(t, 0.5), t)
        return t.to(dtype)
    lo = 0 if dtype == torch.uint8 else low
    t = torch.randint(lo, high + 1, shape, generator=generator)
    if nonzero:
        t = torch.where(t == 0, torch.ones_like(t), t)
    return t.to(dtype)


def assert_close(actual, expected, atol=None, rtol=None):
    """Compare a Kiln result (Tensor, tuple of them) with PyTorch's, dtype included."""
    if isinstance(expected, (tuple, list)):
        assert isinstance(actual, (tuple, list)) and len(actual) == len(expected)
        for a, e in zip(actual, expected):
            assert_close(a, e, atol, rtol)
        return
    a = actual.torch() if isinstance(actual, kiln.Tensor) else actual
    assert a.dtype == expected.dtype, f"dtype {a.dtype} != expected {expected.dtype}"
    assert tuple(a.shape) == tuple(expected.shape), f"shape {tuple(a.shape)} != {tuple(expected.shape)}"
    default = FLOAT_TOL.get(expected.dtype, (0, 0))
    torch.testing.assert_close(a, expected, atol=default[0] if atol is None else atol,
                               rtol=default[1] if rtol is None else rtol, equal_nan=True)


def relative_error(value, reference) -> float:
    """The norm of `value`'s difference from `reference` (a float64 tensor), relative to the
    reference's norm."""
    return ((value.double() - reference).norm() / reference.norm()).item()


def run_sanitized(folder, kernel_source: str, main_source: str, args, isa=()) -> None:
    """Build a CPU kernel's C source with `main_source` under AddressSanitizer (extra compiler
    flags `isa`, e.g. ["-mno-avx512f"] for narrower vectors), run it with `args` on two OpenMP
    threads and assert that it exits cleanly; skips where gcc or its sanitizer runtime is missing."""
    import shutil
    import subprocess

    import pytest
    cc = shutil.which("gcc")
    if cc is None:
        pytest.skip("needs gcc")
    (folder / "kernel.c").write_text(kernel_source)
    (folder / "main.c").write_text(main_source)
    build = subprocess.run([cc, "-O1", "-g", "-fsanitize=address", "-std=gnu11", "-fopenmp", "-march=native", *isa,
                            str(folder / "kernel.c"), str(folder / "main.c"), "-o", str(folder / "run"), "-lm"],
                           capture_output=True, text=True)
    if build.returncode != 0 and "asan" in build.stderr:
        pytest.skip("gcc has no AddressSanitizer runtime here")
    assert build.returncode == 0, build.stderr
    run = subprocess.run([str(folder / "run"), *map(str, args)], capture_output=True, text=True, timeout=300,
                         env={"ASAN_OPTIONS": "detect_leaks=0", "OMP_NUM_THREADS": "2"})
    assert run.returncode == 0 and "AddressSanitizer" not in run.stderr, run.stderr


@contextlib.contextmanager
def cudnn_tf32(allowed: bool):
    """cuDNN's TF32 flag (`torch.backends.cudnn.allow_tf32`) set to `allowed` inside the block,
    its other flags kept. Through `cudnn.flags`, since PyTorch's test modules (which the OpInfo
    test imports) forbid setting the flags directly for the rest of the process."""
    cudnn = torch.backends.cudnn
    with cudnn.flags(enabled=cudnn.enabled, benchmark=cudnn.benchmark, deterministic=cudnn.deterministic,
                     allow_tf32=allowed):
        yield
