"""The Winograd F(2x2, 3x3) convolution template (kiln_ops_builtin.templates.conv_winograd_cpu)
against PyTorch: odd sizes (partial tiles, tile rows that no block height divides), channel
counts off the panels, padding 0 to 2, batches, 16-bit and non-contiguous inputs, the weight
transformed per call and laid out once, epilogues fused through torch.compile, what it declines,
and its C under AddressSanitizer for every vector width."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import kiln
from kiln.runtime.cpu import CpuKernel
from kiln.schedule import schedules_for
from kiln_ops_builtin.templates import conv_winograd_cpu
from tests.frontend.frontend_support import compile_and_compare
from tests.support import assert_close, rand, run_sanitized


def _task(x, w, b=None, **kw):
    op = kiln.ops.conv2d
    task, _, _ = op.task(op.bind([kiln.from_torch(x), kiln.from_torch(w), None if b is None else kiln.from_torch(b)], kw))
    return task


def _reference(x, w, b, **kw):
    """float64 convolution, in the inputs' dtype: float32's own rounding, sums of up to 9 * 40
    products, is what both PyTorch and the template are held to."""
    return F.conv2d(x.double(), w.double(), None if b is None else b.double(), **kw).to(x.dtype)


CASES = [
    ((1, 16, 16, 16), (16, 16, 3, 3), dict(padding=1)),
    ((2, 17, 19, 23), (21, 17, 3, 3), dict(padding=1)),         # odd sizes: partial tiles
    ((1, 20, 17, 18), (33, 20, 3, 3), dict(padding=0)),
    ((1, 16, 15, 31), (40, 16, 3, 3), dict(padding=2)),
    ((1, 24, 12, 40), (17, 24, 3, 3), dict(padding="same")),     # 20 tiles a row: blocks of 14 computed whole
    ((3, 16, 14, 14), (20, 16, 3, 3), dict(padding=1)),         # blocks spanning tile rows and images, the last partial
    ((3, 16, 7, 7), (64, 16, 3, 3), dict(padding=1)),           # more output channels than tiles: one chunk a thread
]


@pytest.mark.parametrize("xs, ws, kw", CASES)
def test_matches_torch(xs, ws, kw):
    x, w, b = rand(xs), rand(ws), rand((ws[0],))
    assert schedules_for(_task(x, w, b, **kw), "cpu")[0] is conv_winograd_cpu.TEMPLATE
    assert_close(kiln.ops.conv2d(x, w, b, **kw), _reference(x, w, b, **kw), atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("xs, ws, kw", CASES[1:3])
def test_weight_laid_out_once(xs, ws, kw):
    x, w, b = rand(xs), rand(ws), rand((ws[0],))
    kernel = CpuKernel(conv_winograd_cpu.render(_task(x, w, b, **kw)))
    prepared, form = kernel.prepare([None, w, None])
    out = torch.empty(_reference(x, w, b, **kw).shape)
    prepared([x, w, b, form], [out])
    assert prepared.program.entry == "kiln_kernel_prepared"
    assert_close(out, _reference(x, w, b, **kw), atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("chunk_bytes", [1, 30000])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_chunks_and_threads(monkeypatch, chunk_bytes, threads):
    """Each thread's share of the blocks in chunks of one block or several (the last partial),
    by 1 to 3 threads: the bits of the one-chunk kernel on one thread, and the float64 values."""
    x, w, b = rand((2, 24, 15, 13)), rand((40, 24, 3, 3)), rand((40,))
    task = _task(x, w, b, padding=1)
    whole = CpuKernel(conv_winograd_cpu.render(task))
    monkeypatch.setattr(conv_winograd_cpu, "CHUNK_BYTES", chunk_bytes)
    chunked = CpuKernel(conv_winograd_cpu.render(task))
    assert chunked.program.source != whole.program.source
    want, got = (torch.empty(_reference(x, w, b, padding=1).shape) for _ in range(2))
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        whole([x, w, b], [want])
        torch.set_num_threads(threads)
        chunked([x, w, b], [got])
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(got, want)
    assert_close(got, _reference(x, w, b, padding=1), atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16bit(dtype):
    x, w = rand((1, 16, 13, 14), dtype, -1, 1), rand((20, 16, 3, 3), dtype, -1, 1)
    assert conv_winograd_cpu.TEMPLATE.applies(_task(x, w, padding=1))
    want = F.conv2d(x.float(), w.float(), None, padding=1).to(dtype)
    assert_close(kiln.ops.conv2d(x, w, None, padding=1), want, atol=2e-2, rtol=2e-2)


def test_non_contiguous_input():
    x, w = rand((1, 18, 16, 16)).permute(0, 3, 1, 2), rand((20, 16, 3, 3))         # (1, 16, 18, 16)
    assert not x.is_contiguous() and conv_winograd_cpu.TEMPLATE.applies(_task(x, w, padding=1))
    assert_close(kiln.ops.conv2d(x, w, None, padding=1), _reference(x, w, None, padding=1), atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("ws, kw", [((20, 16, 3, 3), dict(stride=2, padding=1)), ((20, 16, 3, 3), dict(dilation=2, padding=2)),
                                    ((20, 16, 5, 5), dict(padding=2)), ((20, 8, 3, 3), dict(padding=1, groups=2)),
                                    ((8, 16, 3, 3), dict(padding=1))])
def test_declines(ws, kw):
    """Strides, dilation, other kernels, groups and fewer than 16 channels: not this template's."""
    assert not conv_winograd_cpu.TEMPLATE.applies(_task(rand((1, 16, 16, 16)), rand(ws), **kw))
    few_tiles = _task(rand((1, 16, 7, 7)), rand((16, 16, 3, 3)), padding=1)        # 16 tiles
    assert not conv_winograd_cpu.TEMPLATE.applies(few_tiles)


class _Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, 1, 1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, 1, 1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        return F.relu(self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))) + x)


def test_resnet_block_epilogues_fuse_into_the_template():
    torch.manual_seed(0)
    block = _Block(16).eval()
    for bn in (block.bn1, block.bn2):
        bn.running_mean.uniform_(-1, 1), bn.running_var.uniform_(0.5, 2), bn.weight.data.uniform_(0.5, 2)
    capture, _ = compile_and_compare(block, torch.randn(2, 16, 15, 17), atol=2e-4)
    graph = next(iter(capture.compiled[0].graphs.values())).graph
    convs = [n for n in graph.nodes if n.task.name == "conv2d"]
    assert len(convs) == 2 and all(conv_winograd_cpu.TEMPLATE.applies(n.task) for n in convs)
    assert any(len(n.task.inputs) >= 4 for n in convs)          # weight, bias, input, residual
    compiled = graph.compile()
    assert [s.kernel.kernel.program.entry for s in compiled.steps if s.kernel.task.name == "conv2d"] == \
        ["kiln_kernel_prepared"] * 2


_ASAN_MAIN = r"""
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
void kiln_kernel(const float*, const float*, float*);
void kiln_kernel_prepared(const float*, const float*, float*, const float*);
int64_t kiln_prepare(const float*, const float*, float*, float*);
int main(int argc, char** argv) {
    long nx = atol(argv[1]), nw = atol(argv[2]), no = atol(argv[3]);
    float *x = malloc(nx * 4), *w = malloc(nw * 4), *o = malloc(2 * no * 4);
    for (long i = 0; i < nx; ++i) x[i] = (float)(i % 13) * 0.1f - 0.6f;
    for (long i = 0; i < nw; ++i) w[i] = (float)(i % 7) * 0.1f - 0.3f;
    kiln_kernel(x, w, o);
    float* u = aligned_alloc(64, (kiln_prepare(NULL, w, NULL, NULL) * 4 + 63) / 64 * 64);
    kiln_prepare(NULL, w, NULL, u);
    kiln_kernel_prepared(x, w, o + no, u);
    FILE* f = fopen(argv[4], "wb");
    fwrite(o, 4, 2 * no, f);
    fclose(f);
    return 0;
}
"""


@pytest.mark.parametrize("xs, ws, isa", [((2, 17, 19, 23), (21, 17, 3, 3), []),
                                         ((1, 16, 13, 22), (40, 16, 3, 3), ["-mno-avx512f"]),
                                         ((1, 16, 11, 17), (20, 16, 3, 3), ["-mno-avx"]),
                                         ((3, 16, 14, 14), (20, 16, 3, 3), ["-mno-avx512f"]),
                                         ((3, 16, 7, 7), (64, 16, 3, 3), [])])
def test_clean_under_address_sanitizer(tmp_path, xs, ws, isa):
    x = ((torch.arange(torch.Size(xs).numel()) % 13).float() * 0.1 - 0.6).reshape(xs)
    w = ((torch.arange(torch.Size(ws).numel()) % 7).float() * 0.1 - 0.3).reshape(ws)
    want = F.conv2d(x, w, None, padding=1)
    run_sanitized(tmp_path, conv_winograd_cpu.render(_task(x, w, padding=1)).source, _ASAN_MAIN,
                  [x.numel(), w.numel(), want.numel(), tmp_path / "out.bin"], isa)
    out = torch.frombuffer(bytearray((tmp_path / "out.bin").read_bytes()), dtype=torch.float32).reshape(2, *want.shape)
    assert_close(out, want.expand(2, *want.shape), atol=2e-4, rtol=1e-4)
