"""The CPU GEMM templates (kiln_ops_builtin.templates.gemm_cpu) against PyTorch: odd shapes
(no multiple of any block size), several K blocks, transposed and non-contiguous operands,
batches, 16-bit inputs, convolutions, and epilogues fused through torch.compile."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import kiln
from kiln_ops_builtin.templates import gemm_cpu
from tests.frontend.frontend_support import compile_and_compare
from tests.support import assert_close, rand, run_sanitized


def _task(op_name: str, *args, **kwargs):
    op = getattr(kiln.ops, op_name)
    task, _, _ = op.task(op.bind(args, kwargs))
    return task


@pytest.mark.parametrize("m, k, n", [(1, 1, 1), (7, 33, 100), (1, 257, 7), (100, 7, 1),
                                     (257, 300, 129), (33, 600, 257), (65, 1000, 31),
                                     (3, 300, 1100), (4, 17, 5)])   # few rows: no packing
def test_matmul_odd_shapes(m, k, n):
    x, y = rand((m, k)), rand((k, n))
    # size-1 extents simplify away (a 1 x 1 x 1 "matmul" is one product): the auto-scheduler's
    assert (n > 1 and k > 1) == gemm_cpu.MATMUL.applies(_task("matmul", kiln.from_torch(x), kiln.from_torch(y)))
    # against float64 next to eager's own error: a sum of 1000 products near zero misses a fixed
    # 1e-4 for some draws whichever order adds them
    exact = x.double() @ y.double()
    got = kiln.ops.matmul(x, y).torch()
    assert got.dtype == torch.float32 and got.shape == exact.shape
    eager_error = ((x @ y).double() - exact).abs().max().item()
    assert (got.double() - exact).abs().max().item() <= 3 * eager_error + 1e-6 * exact.abs().max().item()


@pytest.mark.parametrize("xs, ys", [((3, 7, 33), (3, 33, 20)), ((7, 33), (2, 33, 41)),
                                    ((2, 1, 5, 17), (3, 17, 9)), ((4, 2, 33), (4, 33, 600)), ((4, 130), (130,)), ((130,), (130, 6))])
def test_matmul_batched_and_broadcast(xs, ys):
    x, y = rand(xs), rand(ys)
    assert_close(kiln.ops.matmul(x, y), torch.matmul(x, y), atol=1e-4, rtol=1e-4)


def test_transposed_and_non_contiguous_operands():
    x = rand((300, 37)).t()                  # 37 x 300, column-major
    y = rand((129, 600))[:, ::2].t()         # 300 x 129, strided
    assert not x.is_contiguous() and not y.is_contiguous()
    assert_close(kiln.ops.matmul(x, y), x @ y, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16bit_inputs(dtype):
    x, y = rand((33, 257), dtype, -1, 1), rand((257, 45), dtype, -1, 1)
    assert gemm_cpu.MATMUL.applies(_task("matmul", kiln.from_torch(x), kiln.from_torch(y)))
    assert_close(kiln.ops.matmul(x, y), x @ y, atol=2e-2, rtol=2e-2)
    w, b = rand((19, 257), dtype, -1, 1), rand((19,), dtype)
    assert_close(kiln.ops.linear(x, w, b), F.linear(x, w, b), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32])
def test_other_dtypes_go_to_the_auto_scheduler(dtype):
    x, y = rand((7, 9), dtype), rand((9, 5), dtype)
    assert not gemm_cpu.MATMUL.applies(_task("matmul", kiln.from_torch(x), kiln.from_torch(y)))
    assert_close(kiln.ops.matmul(x, y), x @ y)


@pytest.mark.parametrize("xs", [(7, 33), (2, 3, 300), (1, 1), (3, 130), (2, 1, 1300)])
def test_linear_with_bias(xs):
    x, w, b = rand(xs), rand((100, xs[-1])), rand((100,))
    assert_close(kiln.ops.linear(x, w, b), F.linear(x, w, b), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("xs, ws, kw", [
    ((1, 3, 17, 23), (8, 3, 3, 3), dict(stride=1, padding=1)),
    ((2, 5, 33, 7), (7, 5, 3, 2), dict(stride=2, padding=(1, 0))),
    ((1, 4, 10, 10), (5, 4, 3, 3), dict(dilation=2, padding=2)),
    ((1, 6, 9, 9), (4, 3, 1, 1), dict(groups=2)),
    ((1, 16, 14, 14), (16, 1, 3, 3), dict(padding=1, groups=16)),         # depthwise: M = 1
    ((2, 9, 33, 17), (9, 1, 3, 3), dict(stride=2, padding=1, groups=9)),
    ((1, 70, 15, 15), (33, 70, 1, 1), dict()),
])
def test_conv2d(xs, ws, kw):
    """gemm_cpu.CONV's own kernel (conv_cpu and conv_depthwise_cpu take most of these first:
    gemm_cpu.CONV keeps 1x1 and grouped convolutions and symbolic sizes)."""
    from kiln.runtime.cpu import CpuKernel
    x, w, b = rand(xs), rand(ws), rand((ws[0],))
    task = _task("conv2d", kiln.from_torch(x), kiln.from_torch(w), kiln.from_torch(b), **kw)
    assert gemm_cpu.CONV.applies(task)
    want = F.conv2d(x, w, b, **kw)
    out = torch.empty_like(want)
    CpuKernel(gemm_cpu.CONV.render(task))([x, w, b], [out])
    assert_close(out, want, atol=1e-4, rtol=1e-4)
    assert_close(kiln.ops.conv2d(x, w, b, **kw), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("knobs", [{}, dict(KC=96, NC=256, WHOLE_K=0, MR=12)])
def test_conv_planes_written_with_a_panels_outer(knobs):
    """gemm_cpu.CONV on planes of ROWS_OUTER_PIXELS or more: A's panels outer (ROWS_OUTER), B's
    blocks cut to stay in L2 (several along the pixels, and along K with the float32 workspace
    between K blocks), output channels that MR does not divide; the same result as B's panels
    outer. Smaller planes keep B's panels outer."""
    from kiln.runtime.cpu import CpuKernel
    x, w, b = rand((2, 800, 23, 57)), rand((45, 800, 1, 1)), rand((45,))
    task = _task("conv2d", kiln.from_torch(x), kiln.from_torch(w), kiln.from_torch(b))
    program = gemm_cpu.CONV.render(task, **knobs)
    assert "#define ROWS_OUTER 1" in program.source
    assert int(next(ln.split()[2] for ln in program.source.splitlines() if ln.startswith("#define NC "))) < 23 * 57
    out, panels_outer = torch.empty(2, 45, 23, 57), torch.empty(2, 45, 23, 57)
    CpuKernel(program)([x, w, b], [out])
    CpuKernel(gemm_cpu.render(task, **knobs))([x, w, b], [panels_outer])
    assert_close(out, F.conv2d(x, w, b), atol=1e-3, rtol=1e-4)
    assert_close(out, panels_outer, atol=0, rtol=0)
    small = _task("conv2d", kiln.from_torch(rand((1, 16, 14, 14))), kiln.from_torch(rand((8, 16, 1, 1))))
    assert "#define ROWS_OUTER 0" in gemm_cpu.CONV.render(small).source


def test_residual_block_on_large_planes_fuses_into_the_conv():
    """A 1x1 convolution with a residual add and ReLU fused, planes written with A's panels
    outer, through torch.compile."""
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(70, 200, 1)

        def forward(self, x, skip):
            return torch.relu(self.conv(x) + skip)

    capture, _ = compile_and_compare(Block().eval(), rand((1, 70, 36, 36)), rand((1, 200, 36, 36)))
    fused = _fused_nodes(capture)
    assert len(fused) == 1 and gemm_cpu.CONV.applies(fused[0].task)
    assert "#define ROWS_OUTER 1" in gemm_cpu.CONV.render(fused[0].task).source


def test_conv1d():
    x, w = rand((2, 5, 41)), rand((3, 5, 4))
    assert_close(kiln.ops.conv1d(x, w, None, 2, 1), F.conv1d(x, w, None, 2, 1), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("knobs", [dict(MC=224, KC=128, NC=4096, WHOLE_K=0, MR=12),
                                   dict(MC=100, KC=96, NC=64, WHOLE_K=0, MR=14), dict(WHOLE_K=0), {}])
def test_blockings_of_m_n_and_k(knobs):
    """A's blocks that MR does not divide (whole panels each, no row computed twice), N and K
    split in several blocks, K in one block (WHOLE_K)."""
    from kiln.runtime.cpu import CpuKernel
    x, w, b = rand((501, 1000)), rand((130, 1000)), rand((130,))
    task = _task("linear", kiln.from_torch(x), kiln.from_torch(w), kiln.from_torch(b))
    out = torch.empty(501, 130)
    CpuKernel(gemm_cpu.render(task, **knobs))([x, w, b], [out])
    assert_close(out, F.linear(x, w, b), atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("mr", [6, 8, 14])
@pytest.mark.parametrize("k", [300, 1000])
def test_last_panels_of_few_rows(mr, k):
    """M's last panel with 1 .. MR - 1 rows: up to 4 rows a tile of its own with its k dealt out
    to several sets of accumulators (`cpu/micro.h`'s kiln_micro_short), K in one block and in
    several (the tile then added to the float32 workspace), the weight packed per block and laid
    out once; N not whole panels."""
    from kiln.runtime.cpu import CpuKernel
    w, b = rand((45, k)), rand((45,))
    for m in range(2 * mr + 1, 3 * mr + 1):
        x = rand((m, k))
        task = _task("linear", kiln.from_torch(x), kiln.from_torch(w), kiln.from_torch(b))
        kernel = CpuKernel(gemm_cpu.render(task, MR=mr))
        plain, laid_out = torch.empty(m, 45), torch.empty(m, 45)
        kernel([x, w, b], [plain])
        prepared, form = kernel.prepare([None, w, None])
        prepared([x, w, b, form], [laid_out])
        want = F.linear(x.double(), w.double(), b.double()).float()
        assert_close(plain, want, atol=1e-3, rtol=1e-4)
        assert_close(laid_out, want, atol=1e-3, rtol=1e-4)


def test_row_tile_pads_m_least():
    assert [gemm_cpu.row_tile(m) for m in (128, 140, 132, 1024, 197, 5)] == [8, 14, 12, 8, 8, 8]


def test_one_thread_gives_the_same_result():
    x, y = rand((130, 257)), rand((257, 300))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kiln.ops.matmul(x, y).torch()
    finally:
        torch.set_num_threads(threads)
    assert_close(kiln.ops.matmul(x, y), one, atol=0, rtol=0)
    assert_close(one, x @ y, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("xs, ys", [((130, 1000), (1000, 300)), ((6, 50, 257), (6, 257, 40)), ((3, 90, 800), (3, 800, 70))])
def test_threads_give_the_bits_of_one(threads, xs, ys):
    """cpu/gemm.h's threads split batches or panels (K in one block and in several; batches
    split where they divide among the threads): one thread's bits."""
    x, y = rand(xs), rand(ys)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kiln.ops.matmul(x, y).torch()
        torch.set_num_threads(threads)
        many = kiln.ops.matmul(x, y).torch()
    finally:
        torch.set_num_threads(previous)
    assert_close(many, one, atol=0, rtol=0)
    assert_close(one, x @ y, atol=1e-3, rtol=1e-4)


def _fused_nodes(capture):
    graph = next(iter(capture.compiled[0].graphs.values())).graph
    return [n for n in graph.nodes if type(n).__name__ == "FusedOperator"]


def test_mlp_epilogues_fuse_into_the_template():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(33, 100), nn.GELU(), nn.Linear(100, 7), nn.ReLU()).eval()
    capture, _ = compile_and_compare(model, torch.randn(5, 33))
    fused = _fused_nodes(capture)
    assert len(fused) == 2 and all(gemm_cpu.MATMUL.applies(n.task) for n in fused)
    # GELU's erf calls libm: the epilogue hook's loop over a row's columns is `omp simd` (glibc's
    # vector variant, a lane a column; `cpu/common.h`'s KILN_ROW_BY_ROW), ReLU's max does not
    sources = [gemm_cpu.render(n.task).source for n in fused]
    assert ["#define EPILOGUE_LIBM 1" in source for source in sources] == [True, False]
    assert ["#pragma omp simd" in source for source in sources] == [True, False]


class _Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 13, 3, padding=1)
        self.conv2 = nn.Conv2d(13, 13, 3, padding=1)
        self.head = nn.Linear(13, 5)

    def forward(self, x):
        y = F.relu(self.conv1(x))
        y = F.relu(self.conv2(y) + y)
        return self.head(y.mean((2, 3)))


def test_cnn_epilogues_fuse_into_the_template():
    torch.manual_seed(0)
    capture, _ = compile_and_compare(_Residual().eval(), torch.randn(2, 3, 19, 17))
    convs = [n for n in _fused_nodes(capture) if n.task.name == "conv2d"]
    assert len(convs) == 2 and all(gemm_cpu.CONV.applies(n.task) for n in convs)
    assert all("#define EPILOGUE_LIBM 0" in gemm_cpu.render_conv(n.task).source for n in convs)


_ASAN_MAIN = r"""
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
void kiln_kernel(const float*, const float*, const float*, float*);
void kiln_kernel_prepared(const float*, const float*, const float*, float*, const float*);
int64_t kiln_prepare(const float*, const float*, const float*, float*, float*);
int main(int argc, char** argv) {
    long m = atol(argv[1]), k = atol(argv[2]), n = atol(argv[3]);
    float *x = malloc(m * k * 4), *w = malloc(n * k * 4), *b = malloc(n * 4), *o = malloc(2 * m * n * 4);
    for (long i = 0; i < m * k; ++i) x[i] = (float)(i % 13) * 0.1f - 0.6f;
    for (long i = 0; i < n * k; ++i) w[i] = (float)(i % 7) * 0.1f - 0.3f;
    for (long i = 0; i < n; ++i) b[i] = (float)(i % 5);
    kiln_kernel(x, w, b, o);
    int64_t floats = kiln_prepare(NULL, w, NULL, NULL, NULL);    /* the weight laid out once */
    float* packed = aligned_alloc(64, (floats * 4 + 63) / 64 * 64);
    kiln_prepare(NULL, w, NULL, NULL, packed);
    kiln_kernel_prepared(x, w, b, o + m * n, packed);
    FILE* f = fopen(argv[4], "wb");
    fwrite(o, 4, 2 * m * n, f);
    fclose(f);
    return 0;
}
"""


@pytest.mark.parametrize("m, k, n, isa", [(3, 130, 50, []), (37, 300, 70, []), (37, 333, 70, ["-mno-avx512f"]),
                                         (37, 333, 70, ["-mno-avx"]), (37, 1000, 70, []), (700, 1000, 77, []),
                                         (2, 33, 70, ["-mno-avx512f"])])
def test_kernels_are_clean_under_address_sanitizer(tmp_path, m, k, n, isa):
    """The kernel packing its weight and the one reading it laid out once (`kiln_prepare`), also
    built for 8- and 4-float vectors (the weight's packing transposes VW x VW blocks); K = 1000
    in K blocks (WHOLE_K is 768); M = 700 in several A blocks (each sweep's last B panel
    prefetches the first again, `GemmKnobs.B_PREFETCH`); up to 4 rows on their own path."""
    # regression: the few-row path asked aligned_alloc for sizes that are not multiples of 64
    x = ((torch.arange(m * k) % 13).float() * 0.1 - 0.6).reshape(m, k)
    w = ((torch.arange(n * k) % 7).float() * 0.1 - 0.3).reshape(n, k)
    b = (torch.arange(n) % 5).float()
    task = _task("linear", kiln.from_torch(x), kiln.from_torch(w), kiln.from_torch(b))
    program = gemm_cpu.render(task)
    assert program.preparation is not None and program.preparation.input == 1
    run_sanitized(tmp_path, program.source, _ASAN_MAIN, [m, k, n, tmp_path / "out.bin"], isa)
    out = torch.frombuffer(bytearray((tmp_path / "out.bin").read_bytes()), dtype=torch.float32).reshape(2, m, n)
    assert_close(out, F.linear(x, w, b).expand(2, m, n), atol=1e-4, rtol=1e-4)


_ASAN_MATMUL_MAIN = r"""
#include <stdio.h>
#include <stdlib.h>
void kiln_kernel(const float*, const float*, float*);
int main(int argc, char** argv) {
    long m = atol(argv[1]), k = atol(argv[2]), n = atol(argv[3]);
    float *x = malloc(m * k * 4), *y = malloc(k * n * 4), *o = malloc(m * n * 4);
    for (long i = 0; i < m * k; ++i) x[i] = (float)(i % 13) * 0.1f - 0.6f;
    for (long i = 0; i < k * n; ++i) y[i] = (float)(i % 7) * 0.1f - 0.3f;
    kiln_kernel(x, y, o);
    FILE* f = fopen(argv[4], "wb");
    fwrite(o, 4, m * n, f);
    fclose(f);
    return 0;
}
"""


@pytest.mark.parametrize("isa", [[], ["-mno-avx512f"], ["-mno-avx"]])
@pytest.mark.parametrize("m, k, n, knobs", [(7, 33, 100, {}), (33, 257, 257, dict(NC=64, KC=96, WHOLE_K=0)),
                                            (100, 7, 1100, dict(NC=512))])
def test_b_along_n_packed_by_rows_under_address_sanitizer(tmp_path, m, k, n, knobs, isa):
    """B read along n (a row-major matmul operand) is packed a block of rows at a time and dealt
    out to the panels: N in several NC blocks, the last panel part padding, K in several blocks,
    on each vector width."""
    x = ((torch.arange(m * k) % 13).float() * 0.1 - 0.6).reshape(m, k)
    y = ((torch.arange(k * n) % 7).float() * 0.1 - 0.3).reshape(k, n)
    program = gemm_cpu.render(_task("matmul", kiln.from_torch(x), kiln.from_torch(y)), **knobs)
    assert "#define B_BY_K 0" in program.source
    run_sanitized(tmp_path, program.source, _ASAN_MATMUL_MAIN, [m, k, n, tmp_path / "out.bin"], isa)
    out = torch.frombuffer(bytearray((tmp_path / "out.bin").read_bytes()), dtype=torch.float32).reshape(m, n)
    assert_close(out, x @ y, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("m,n", [(5, 10), (1, 3)])
def test_an_empty_sum_gives_zeros(m, n):
    """K = 0: every output element is an empty sum (the template declines; the result is 0)."""
    a, b = torch.randn(m, 0), torch.randn(0, n)
    got = kiln.ops.matmul(kiln.from_torch(a), kiln.from_torch(b)).torch()
    assert torch.equal(got, torch.zeros(m, n))
    bias = torch.randn(m, n)
    out = torch.compile(lambda x, y, z: torch.addmm(z, x, y, beta=0.2, alpha=0.6), backend="kiln")(a, b, bias)
    torch.testing.assert_close(out, 0.2 * bias)


def test_a_task_is_matched_once_and_rendering_leaves_the_match_as_it_was():
    """`match_cpu_gemm` is found once per task (fusion, the compile and the rendering all ask):
    rendering adds the sizes it writes to a copy, so a task rendered again, at other knobs or
    the same, gives what a fresh match of an equal task gives."""
    from kiln.ir import SymSize
    from kiln_ops_builtin.templates.cpu_hooks import match_cpu_gemm

    def task():
        x = kiln.symbol([SymSize.named("s0", 7), 33])
        return _task("linear", x, kiln.symbol([20, 33]), kiln.symbol([20]))
    t = task()
    matched = match_cpu_gemm(t)
    names = list(matched.sizes.names)
    assert match_cpu_gemm(t) is matched and gemm_cpu.MATMUL.applies(t)
    knobs = [gemm_cpu.GemmKnobs.settings(0)[0], gemm_cpu.GemmKnobs.settings(1)[-1]]
    sources = [gemm_cpu.render(t, **k).source for k in knobs + knobs]
    assert matched.sizes.names == names and "int64_t" in sources[0]
    assert sources == [gemm_cpu.render(task(), **k).source for k in knobs + knobs]


def test_applies_decides_without_rendering_the_hooks(monkeypatch):
    """Fusion asks `applies` of every candidate group, and most never render: the answer comes
    from the task's GEMM form (`gemm_form`), not from writing its C hooks, and is the one the
    full match gives (a match where the form is found, at K > 0; none where it is not)."""
    from kiln.ir import SymSize
    from kiln_ops_builtin.templates import cpu_hooks

    def tasks():
        x = kiln.symbol([SymSize.named("s0", 7), 33])
        return [_task("linear", x, kiln.symbol([20, 33]), kiln.symbol([20])),
                _task("matmul", kiln.symbol([5, 8]), kiln.symbol([8, 3])),
                _task("matmul", kiln.symbol([5, 0]), kiln.symbol([0, 3])),
                _task("matmul", kiln.symbol([5, 8], "int32"), kiln.symbol([8, 3], "int32"))]

    def no_hooks(*args, **kwargs):
        raise AssertionError("applies rendered a hook")
    with monkeypatch.context() as patched:
        patched.setattr(cpu_hooks, "render_epilogue_row", no_hooks)
        answers = [gemm_cpu.MATMUL.applies(t) for t in tasks()]
    assert answers == [True, True, False, False]
    matches = [cpu_hooks.match_cpu_gemm(t) for t in tasks()]
    assert answers == [g is not None and g.K > 0 for g in matches]
