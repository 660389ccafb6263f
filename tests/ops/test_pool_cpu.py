"""The CPU max-pool template (kiln_ops_builtin.templates.pool_cpu) against PyTorch: odd shapes,
strides, dilation, ceil_mode, 16-bit inputs, NaN and -inf, non-contiguous inputs, epilogues fused
after the pool, and AddressSanitizer for every vector width."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import kiln
from kiln_ops_builtin.templates import pool_cpu
from tests.frontend.frontend_support import compile_and_compare
from tests.support import assert_close, rand, run_sanitized


def _task(x, **kw):
    op = kiln.ops.max_pool2d
    task, _, _ = op.task(op.bind([kiln.from_torch(x)], kw))
    return task


WINDOWS = [dict(kernel_size=3, stride=2, padding=1), dict(kernel_size=3, stride=2, padding=1, ceil_mode=True),
           dict(kernel_size=(2, 3), stride=(1, 2), padding=(1, 1), dilation=(2, 1)), dict(kernel_size=2),
           dict(kernel_size=(3, 1), stride=1, padding=(1, 0))]


@pytest.mark.parametrize("kw", WINDOWS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_max_pool2d_matches_torch(kw, dtype):
    x = rand((2, 5, 13, 37), dtype)           # rows longer than the widest vector block
    x[0, 1, 2, 3], x[1, 4, 7, 20], x[1, 2] = float("nan"), float("-inf"), float("-inf")
    assert pool_cpu.TEMPLATE.applies(_task(x, **kw))
    got, want = kiln.ops.max_pool2d(x, **kw).torch(), F.max_pool2d(x, **kw)
    assert torch.equal(got.isnan(), want.isnan())
    assert_close(got.nan_to_num(), want.nan_to_num(), atol=0, rtol=0)


def test_non_contiguous_input():
    x = rand((2, 9, 11, 4)).permute(0, 3, 1, 2)
    assert_close(kiln.ops.max_pool2d(x, 3, 2, 1), F.max_pool2d(x, 3, 2, 1), atol=0, rtol=0)


@pytest.mark.parametrize("x", [rand((3, 8, 7)), rand((2, 3, 7, 6), torch.int32, low=-100, high=100),
                               rand((2, 3, 7, 6), torch.float64)])
def test_unbatched_and_other_dtypes_go_to_the_auto_scheduler(x):
    assert not pool_cpu.TEMPLATE.applies(_task(x, kernel_size=3, stride=2, padding=1))
    assert_close(kiln.ops.max_pool2d(x, 3, 2, 1), F.max_pool2d(x, 3, 2, 1))


class _Stem(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 8, 3, 2, 1, bias=False), nn.BatchNorm2d(8)

    def forward(self, x):
        return F.max_pool2d(F.relu(self.bn(self.conv(x))), 3, 2, 1) * 0.5 - 1.0


def test_epilogues_fuse_after_the_pool():
    torch.manual_seed(0)
    capture, _ = compile_and_compare(_Stem().eval(), torch.randn(2, 3, 27, 30))
    graph = next(iter(capture.compiled[0].graphs.values())).graph
    pools = [n for n in graph.nodes if n.task.name == "max_pool2d"]
    assert len(pools) == 1 and type(pools[0]).__name__ == "FusedOperator" and pool_cpu.TEMPLATE.applies(pools[0].task)


_ASAN_MAIN = r"""
#include <stdio.h>
#include <stdlib.h>
void kiln_kernel(const float*, float*);
int main(int argc, char** argv) {
    long nx = atol(argv[1]), no = atol(argv[2]);
    float *x = malloc(nx * 4), *o = malloc(no * 4);
    for (long i = 0; i < nx; ++i) x[i] = (float)(i % 13) * 0.1f - 0.6f;
    kiln_kernel(x, o);
    FILE* f = fopen(argv[3], "wb");
    fwrite(o, 4, no, f);
    fclose(f);
    return 0;
}
"""


@pytest.mark.parametrize("shape, kw, isa", [((2, 5, 13, 21), WINDOWS[1], []), ((1, 3, 17, 40), WINDOWS[2], ["-mno-avx512f"]),
                                            ((1, 3, 9, 11), WINDOWS[0], ["-mno-avx"])])
def test_clean_under_address_sanitizer(tmp_path, shape, kw, isa):
    x = ((torch.arange(torch.Size(shape).numel()) % 13).float() * 0.1 - 0.6).reshape(shape)
    want = F.max_pool2d(x, **kw)
    run_sanitized(tmp_path, pool_cpu.render(_task(x, **kw)).source, _ASAN_MAIN, [x.numel(), want.numel(), tmp_path / "out.bin"], isa)
    out = torch.frombuffer(bytearray((tmp_path / "out.bin").read_bytes()), dtype=torch.float32).reshape(want.shape)
    assert_close(out, want, atol=0, rtol=0)
