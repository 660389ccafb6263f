"""Float math in the CPU kernels' vectorized loops calls glibc's vector variants (libmvec, which
the C prelude declares SIMD-callable): each function against PyTorch in float64 over its domain
and special values (+-inf, NaN, +-0, overflow, denormal results), at a length that leaves a
scalar remainder; and the kernel really calls the vector variant."""
import platform

import pytest
import torch

import kiln
from kiln.schedule import build_task

SPECIAL = [float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 1e-30, -1e-30]
# name: (low, high) of the values tried besides SPECIAL
FUNCS = {
    "exp": (-104.0, 89.0), "expm1": (-20.0, 89.0), "log": (1e-30, 1e30), "log1p": (-0.999, 1e6), "log2": (1e-30, 1e30),
    "sin": (-100.0, 100.0), "cos": (-100.0, 100.0), "tan": (-1.5, 1.5), "tanh": (-12.0, 12.0), "erf": (-6.0, 6.0),
    "asin": (-1.0, 1.0), "acos": (-1.0, 1.0), "atan": (-1e4, 1e4), "sinh": (-90.0, 90.0), "cosh": (-90.0, 90.0),
    "asinh": (-1e4, 1e4), "acosh": (1.0, 1e4), "atanh": (-0.999, 0.999),
}
VECTORIZED_SINCE = {"exp": 22, "log": 22, "sin": 22, "cos": 22}       # glibc 2.x; the others 2.35


def _values(low, high):
    return torch.cat([torch.linspace(low, high, 4093), torch.tensor(SPECIAL)]).float()


@pytest.mark.parametrize("name", list(FUNCS))
def test_matches_torch_within_a_few_ulp(name):
    x = _values(*FUNCS[name])
    got = getattr(kiln.ops, name)(x).torch()
    want = getattr(torch, name)(x.double()).float().double()
    torch.testing.assert_close(got.double(), want, rtol=5e-7, atol=1e-44, equal_nan=True)


def _glibc_minor() -> int | None:
    lib, version = platform.libc_ver()
    if lib != "glibc" or platform.machine() != "x86_64" or not version.startswith("2."):
        return None
    return int(version.split(".")[1])


@pytest.mark.parametrize("name", list(FUNCS))
def test_kernels_call_the_vector_variant(name):
    minor = _glibc_minor()
    if minor is None or minor < VECTORIZED_SINCE.get(name, 35):
        pytest.skip("libmvec has no vector variant of this function here")
    op = getattr(kiln.ops, name)
    task, _, _ = op.task(op.bind((kiln.from_torch(_values(*FUNCS[name])),), {}))
    library = build_task(task, kiln.device("cpu")).kernel.path.read_bytes()
    assert f"v_{name}f".encode() in library and b"_ZGV" in library
