"""Runs a generated CUDA kernel of float32 buffers on the host, no GPU needed: the kernel's own
source built with g++, a std::thread per CUDA thread of a block, a barrier for
__syncthreads, the blocks one after another. For kernels that use no device intrinsics (the
column and moments first passes over float32 data)."""
from __future__ import annotations

import re
import shutil
import subprocess

import numpy as np
import pytest

HOST_CUDA = r"""
#include <algorithm>
#include <barrier>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>
using std::min;
struct D3 { unsigned x, y, z; };
thread_local D3 threadIdx;
D3 blockIdx;
std::barrier<>* block_barrier;
#define __global__
#define __launch_bounds__(threads)
#define __restrict__
#define __shared__ static
#define __syncthreads() block_barrier->arrive_and_wait()
template <typename T, int V>
struct alignas(sizeof(T) * V < 16 ? sizeof(T) * V : 16) kiln_pack { T v[V]; };
"""

HOST_MAIN = r"""
int main(int argc, char** argv) {
    const unsigned gx = atoi(argv[1]), gy = atoi(argv[2]), threads = atoi(argv[3]);
    std::vector<std::vector<float>> buf;
    for (int k = 4; k + 1 < argc; k += 2) {
        buf.emplace_back(atol(argv[k]));
        FILE* f = fopen(argv[k + 1], "rb");
        if (fread(buf.back().data(), 4, buf.back().size(), f) != buf.back().size()) return 1;
        fclose(f);
    }
    for (unsigned by = 0; by < gy; ++by) for (unsigned bx = 0; bx < gx; ++bx) {
        blockIdx = {bx, by, 0};
        std::barrier<> b(threads); block_barrier = &b;
        std::vector<std::thread> pool;
        for (unsigned k = 0; k < threads; ++k) pool.emplace_back([&, k] {
            threadIdx = {k, 0, 0}; KERNEL(ARGS); });
        for (auto& th : pool) th.join();
    }
    for (int k = 4; k + 1 < argc; k += 2) {
        FILE* f = fopen(argv[k + 1], "wb"); fwrite(buf[(k - 4) / 2].data(), 4, buf[(k - 4) / 2].size(), f); fclose(f);
    }
}
"""


def kernel_sources(program) -> dict[str, str]:
    """Each kernel's source in `program` by its name."""
    parts = program.source.split('extern "C" __global__ void ')[1:]
    return {re.match(r"(?:__launch_bounds__\(\d+\) )?(\w+)\(", part).group(1): part for part in parts}


def run_on_host_threads(program, launch, buffers: list[np.ndarray], tmp_path) -> list[np.ndarray]:
    """Run `launch` of `program` (a fixed grid, one float32 buffer an argument, in order) over
    `buffers` on host threads; the buffers as the kernel left them. Skips without g++ and its
    C++20 <barrier>."""
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("needs g++")
    args = ", ".join(f"buf[{k}].data()" for k in range(len(buffers)))
    main = HOST_MAIN.replace("KERNEL", launch.kernel).replace("ARGS", args)
    (tmp_path / "k.cpp").write_text(HOST_CUDA + 'extern "C" __global__ void ' + kernel_sources(program)[launch.kernel]
                                    + main)
    build = subprocess.run([gxx, "-O1", "-std=c++20", "-pthread", str(tmp_path / "k.cpp"), "-o", str(tmp_path / "k")],
                           capture_output=True, text=True)
    if build.returncode and "barrier" in build.stderr:
        pytest.skip("g++ without C++20 <barrier>")
    assert build.returncode == 0, build.stderr
    files = []
    for k, b in enumerate(buffers):
        path = tmp_path / f"b{k}.bin"
        np.ascontiguousarray(b, dtype=np.float32).tofile(path)
        files += [str(b.size), str(path)]
    grid, block = launch.grid, launch.block
    subprocess.run([str(tmp_path / "k"), str(grid[0]), str(grid[1]), str(block[0]), *files], check=True, timeout=300)
    return [np.fromfile(tmp_path / f"b{k}.bin", dtype=np.float32).reshape(b.shape) for k, b in enumerate(buffers)]
