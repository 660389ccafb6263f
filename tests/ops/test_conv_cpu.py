"""The CPU convolution templates (kiln_ops_builtin.templates.conv_cpu, conv_depthwise_cpu)
against PyTorch: odd shapes (no multiple of any block), strides, padding, dilation, the three
row numberings of conv_cpu (rows aligned to output rows, virtual and gathered pixels), K in
several blocks, 16-bit inputs, non-contiguous inputs, epilogues fused through torch.compile,
what they decline, and their C under AddressSanitizer."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import kiln
from kiln.ir import Task
from kiln.runtime.cpu import CpuKernel
from kiln.schedule import schedules_for
from kiln_ops_builtin.conv import conv2d
from kiln_ops_builtin.templates import conv_cpu, conv_depthwise_cpu, gemm_cpu
from tests.frontend.frontend_support import compile_and_compare
from tests.support import assert_close, rand, run_sanitized


def _task(*args, **kwargs):
    op = kiln.ops.conv2d
    task, _, _ = op.task(op.bind(args, kwargs))
    return task


# (input, weight, conv2d arguments); the comment says which row numbering conv_cpu takes
CASES = [
    ((1, 3, 17, 23), (8, 3, 3, 3), dict(stride=1, padding=1)),                 # virtual pixels
    ((2, 5, 33, 7), (7, 5, 3, 2), dict(stride=2, padding=(1, 0))),
    ((1, 4, 10, 11), (5, 4, 3, 3), dict(dilation=2, padding=2)),
    ((1, 3, 37, 29), (19, 3, 7, 7), dict(stride=2, padding=3)),                # a stem
    ((2, 9, 9, 6), (40, 9, 3, 3), dict(padding=1)),                            # gathered pixels
    ((1, 33, 5, 5), (70, 33, 3, 3), dict(stride=2, padding=1, dilation=(1, 2))),
    ((1, 6, 12, 13), (9, 6, 1, 3), dict(padding="same")),
    ((1, 6, 12, 13), (9, 6, 2, 4), dict(padding="same", dilation=(1, 2))),     # padded more after
    ((1, 7, 8, 9), (5, 7, 3, 3), dict(padding="valid", stride=(3, 2))),
    ((1, 5, 16, 14), (9, 5, 3, 3), dict(padding=1)),                           # aligned rows: 14 per row
    ((2, 6, 7, 7), (20, 6, 3, 3), dict(padding=1)),                            # aligned, 7 per row
    ((1, 4, 33, 32), (6, 4, 3, 3), dict(stride=2, padding=1)),                 # aligned, 8 of 16
    ((1, 200, 7, 7), (96, 200, 1, 1), {}),                                     # 1x1, channels fill panels
    ((2, 193, 13, 13), (90, 193, 1, 1), dict(stride=2)),
    ((1, 5, 1, 1), (9, 5, 3, 3), dict(padding=1)),                             # a 1x1 input
    ((2, 200, 14, 14), (64, 200, 1, 1), {}),                                   # 1x1 read in place
    ((1, 5, 16, 15), (9, 5, 3, 2), {}),                                        # valid, read in place
    ((2, 5, 9, 6), (7, 5, 3, 3), {}),                                          # gathered from the input
    ((1, 6, 11, 20), (10, 6, 1, 3), dict(stride=2, padding=(0, 1))),           # one phase along h
    ((1, 6, 20, 11), (10, 6, 3, 1), dict(stride=(2, 3), padding=(2, 0), dilation=(2, 1))),
]


@pytest.mark.parametrize("xs, ws, kw", CASES)
def test_conv2d_matches_torch(xs, ws, kw):
    x, w, b = rand(xs), rand(ws), rand((ws[0],))
    task = _task(kiln.from_torch(x), kiln.from_torch(w), kiln.from_torch(b), **kw)
    assert schedules_for(task, "cpu")[0] is conv_cpu.TEMPLATE
    assert_close(kiln.ops.conv2d(x, w, b, **kw), F.conv2d(x, w, b, **kw), atol=1e-4, rtol=1e-4)


def test_every_row_numbering_is_tested():
    """With 16-float vectors: rows aligned to output rows, virtual pixels, gathered pixels."""
    modes = set()
    for xs, ws, kw in CASES:
        c = conv_cpu.match_conv(_task(kiln.from_torch(rand(xs)), kiln.from_torch(rand(ws)), None, **kw))
        modes.add("aligned" if c.out_shape[3] % conv_cpu.row_height(c) == 0 else "gathered" if c.gather else "virtual")
    assert modes == {"aligned", "gathered", "virtual"}


@pytest.mark.parametrize("xs, ws, kw, in_place", [
    ((2, 200, 14, 14), (64, 200, 1, 1), {}, True),
    ((1, 5, 16, 15), (9, 5, 3, 2), {}, True),
    ((2, 5, 9, 6), (7, 5, 3, 3), {}, True),
    ((2, 8, 14, 14), (12, 4, 1, 1), dict(groups=2), True),
    ((2, 200, 14, 14), (64, 200, 1, 1), dict(padding=1), False),               # padded
    ((2, 200, 14, 14), (64, 200, 1, 1), dict(stride=2), False),
    ((1, 200, 15, 15), (64, 200, 1, 1), dict(dilation=2, padding=1), False),
])
def test_input_read_in_place_as_its_planes(xs, ws, kw, in_place):
    """A float32 input laid out as its planes is read in place (its planes are not copied), also
    where it is not contiguous in the caller's hands; a 16-bit one never is."""
    x, w, b = rand(xs), rand(ws), rand((ws[0],))
    task = _task(kiln.from_torch(x), kiln.from_torch(w), kiln.from_torch(b), **kw)
    assert conv_cpu.match_conv(task).input_is_planes == in_place
    assert ("#define INPUT_PLANES_OK 1" in conv_cpu.render(task).source) == in_place
    half = _task(kiln.from_torch(x.half()), kiln.from_torch(w.half()), None, **kw)
    assert not conv_cpu.match_conv(half).input_is_planes
    strided = x.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
    assert not strided.is_contiguous()
    assert_close(kiln.ops.conv2d(strided, w, b, **kw), F.conv2d(x, w, b, **kw), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16bit_inputs_accumulate_in_float32(dtype):
    x, w, b = rand((2, 5, 11, 9), dtype), rand((12, 5, 3, 3), dtype), rand((12,), dtype)
    task = _task(kiln.from_torch(x), kiln.from_torch(w), kiln.from_torch(b), stride=2, padding=1)
    assert conv_cpu.TEMPLATE.applies(task)
    want = F.conv2d(x.float(), w.float(), b.float(), stride=2, padding=1).to(dtype)
    assert_close(kiln.ops.conv2d(x, w, b, stride=2, padding=1), want, atol=2e-2, rtol=2e-2)


def test_non_contiguous_input_and_weight():
    x = rand((2, 13, 11, 6)).permute(0, 3, 2, 1)            # (2, 6, 11, 13), strided
    w = rand((3, 3, 6, 10)).permute(3, 2, 1, 0)             # (10, 6, 3, 3)
    assert not x.is_contiguous() and not w.is_contiguous()
    assert_close(kiln.ops.conv2d(x, w, None, 1, 1), F.conv2d(x, w, None, 1, 1), atol=1e-4, rtol=1e-4)
    model = nn.Conv2d(6, 10, 3, padding=1).eval()
    compile_and_compare(model, x.contiguous(memory_format=torch.channels_last))


@pytest.mark.parametrize("knobs", [dict(MC=28, KC=40, NC=64, WHOLE_K=0, MR=14), dict(MC=96, KC=64, WHOLE_K=0, MR=8),
                                   dict(KC=40, WHOLE_K=0, PREFETCH=0), dict(KC=40, WHOLE_K=0, PREFETCH=39), {}])
@pytest.mark.parametrize("xs, ws", [((1, 11, 13, 15), (37, 11, 3, 3)), ((1, 30, 6, 5), (70, 30, 3, 3))])
def test_blockings(knobs, xs, ws):
    """K in several blocks (the float32 workspace), N in several blocks, MR not dividing MC, rows of
    A prefetched from none to all but the first of a K block ahead."""
    x, w, b = rand(xs), rand(ws), rand((ws[0],))
    task = _task(kiln.from_torch(x), kiln.from_torch(w), kiln.from_torch(b), padding=1)
    want = F.conv2d(x, w, b, padding=1)
    out = torch.empty_like(want)
    CpuKernel(conv_cpu.render(task, **knobs))([x, w, b], [out])
    assert_close(out, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("xs, ws, kw", [((1, 11, 13, 15), (37, 11, 3, 3), dict(padding=1)),
                                        ((2, 7, 19, 17), (20, 7, 5, 5), dict(stride=2, padding=2, dilation=(1, 2))),
                                        ((1, 40, 9, 9), (24, 40, 1, 1), dict(stride=2))])
def test_k_blocks_are_whole_input_channels(xs, ws, kw):
    """The micro-kernel reads a channel's taps at fixed offsets from one pointer (cpu/micro.h's
    A_TAPS): a K block of 40 rows is cut down to whole channels (36 of 3x3, 25 of 5x5 taps)."""
    x, w, b = rand(xs), rand(ws), rand((ws[0],))
    task = _task(kiln.from_torch(x), kiln.from_torch(w), kiln.from_torch(b), **kw)
    program = conv_cpu.render(task, KC=40, WHOLE_K=0)
    taps = ws[2] * ws[3]
    assert f"#define KC {40 // taps * taps}\n" in program.source
    want = F.conv2d(x, w, b, **kw)
    out = torch.empty_like(want)
    CpuKernel(program)([x, w, b], [out])
    assert_close(out, want, atol=1e-4, rtol=1e-4)


def test_one_thread_gives_the_same_result():
    x, w = rand((2, 16, 20, 19)), rand((24, 16, 3, 3))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kiln.ops.conv2d(x, w, None, 1, 1).torch()
    finally:
        torch.set_num_threads(threads)
    assert_close(kiln.ops.conv2d(x, w, None, 1, 1), one, atol=0, rtol=0)


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("knobs", [{}, dict(KC=36, WHOLE_K=0)])
@pytest.mark.parametrize("prepared", [False, True])
@pytest.mark.parametrize("xs, ws", [((4, 16, 20, 19), (24, 16, 3, 3)), ((6, 8, 9, 9), (40, 8, 1, 1)),
                                    ((3, 20, 6, 6), (200, 20, 3, 3))])
def test_threads_split_the_work(threads, knobs, prepared, xs, ws):
    """Whatever the split (cpu/gemm.h: whole images where an image's pixels outnumber the
    channels, each thread with its own workspace where K is in blocks; else channels or pixels,
    images inside the weight's blocks where it is laid out once and larger): the bits of one
    thread. 3 threads split 6 images two each; 4 images among 3 threads, and 3 among 2, go by
    channels or pixels."""
    x, w = rand(xs), rand(ws)
    task = _task(kiln.from_torch(x), kiln.from_torch(w), None, padding=ws[2] // 2)
    kernel = CpuKernel(conv_cpu.render(task, **knobs))
    want = F.conv2d(x, w, None, padding=ws[2] // 2)
    outs = []
    previous = torch.get_num_threads()
    try:
        for n in (1, threads):
            torch.set_num_threads(n)
            outs.append(torch.empty_like(want))
            if prepared:
                call, form = kernel.prepare([None, w])
                call([x, w, form], [outs[-1]])
            else:
                kernel([x, w], [outs[-1]])
    finally:
        torch.set_num_threads(previous)
    assert_close(outs[0], want, atol=1e-4, rtol=1e-4)
    assert_close(outs[1], outs[0], atol=0, rtol=0)


def test_declines_what_it_does_not_compute():
    x = kiln.from_torch(rand((1, 6, 9, 9)))
    assert not conv_cpu.TEMPLATE.applies(_task(x, kiln.from_torch(rand((6, 1, 3, 3))), None, groups=6))   # depthwise
    one = _task(x, kiln.from_torch(rand((4, 6, 1, 1))))                          # 1x1: a plain GEMM
    assert not conv_cpu.TEMPLATE.applies(one) and gemm_cpu.CONV.applies(one)
    wide = _task(kiln.from_torch(rand((1, 256, 28, 28))), kiln.from_torch(rand((24, 256, 1, 1))))
    assert not conv_cpu.TEMPLATE.applies(wide)        # its pixels fill panels better than its channels
    shallow = _task(kiln.from_torch(rand((1, 96, 7, 7))), kiln.from_torch(rand((64, 96, 1, 1))))
    assert not conv_cpu.TEMPLATE.applies(shallow)     # K too small to pay for the transposed tiles
    projection = lambda n, stride, side=28, dtype=torch.float32: _task(
        kiln.from_torch(rand((n, 512, side, side), dtype)), kiln.from_torch(rand((128, 512, 1, 1), dtype)), None, stride=stride)
    assert conv_cpu.TEMPLATE.applies(projection(1, 1))      # its input fits L2: copied into planes here
    assert conv_cpu.TEMPLATE.applies(projection(2, 1))      # larger, read in place
    assert conv_cpu.TEMPLATE.applies(projection(2, 1, 56))  # read in place, its channels a page apart or more
    assert not conv_cpu.TEMPLATE.applies(projection(2, 1, 28, torch.float16))   # 16-bit: copied, the plain GEMM's
    assert conv_cpu.TEMPLATE.applies(projection(2, 2))      # a strided one stays
    # a task named conv2d whose sum is not the convolution its attributes describe
    task = _task(x, kiln.from_torch(rand((4, 6, 3, 3))), None, stride=2)
    forged = Task("conv2d", task.inputs, [conv2d.definition(task.inputs[0], task.inputs[1], stride=2, padding=1)],
                  {**task.attrs, "padding": 1, "stride": 1})
    assert conv_cpu.TEMPLATE.applies(task) and not conv_cpu.TEMPLATE.applies(forged)


DEPTHWISE = [
    ((1, 16, 14, 14), (16, 1, 3, 3), dict(padding=1)),
    ((2, 9, 33, 17), (9, 1, 3, 3), dict(stride=2, padding=1)),
    ((1, 5, 40, 37), (5, 1, 5, 5), dict(stride=(1, 2), padding=(2, 1), dilation=(1, 2))),   # rows over 2 blocks
    ((1, 7, 6, 71), (7, 1, 3, 2), dict(padding="same")),
    ((1, 3, 10, 8), (3, 1, 2, 3), dict(stride=3)),
    ((1, 6, 9, 21), (6, 1, 1, 1), {}),                                       # a per-channel scale
    ((1, 3, 70, 66), (3, 1, 3, 3), dict(padding=1)),                         # rows staged twice
    ((1, 2, 3, 4200), (2, 1, 3, 3), dict(padding=1)),                        # a row longer than a stage
    ((1, 4, 9, 20), (4, 1, 1, 3), dict(stride=2, padding=(0, 1))),           # one phase along h
]


@pytest.mark.parametrize("xs, ws, kw", DEPTHWISE)
def test_depthwise_matches_torch(xs, ws, kw):
    x, w, b = rand(xs), rand(ws), rand((ws[0],))
    kw = dict(kw, groups=xs[1])
    task = _task(kiln.from_torch(x), kiln.from_torch(w), kiln.from_torch(b), **kw)
    assert schedules_for(task, "cpu")[0] is conv_depthwise_cpu.TEMPLATE
    assert_close(kiln.ops.conv2d(x, w, b, **kw), F.conv2d(x, w, b, **kw), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("vecs", [1, 2, 8])
def test_depthwise_blocks(vecs):
    x, w = rand((2, 6, 13, 45)), rand((6, 1, 3, 3))
    task = _task(kiln.from_torch(x), kiln.from_torch(w), None, stride=2, padding=1, groups=6)
    want = F.conv2d(x, w, None, stride=2, padding=1, groups=6)
    out = torch.empty_like(want)
    CpuKernel(conv_depthwise_cpu.render(task, DW_VECS=vecs))([x, w], [out])
    assert_close(out, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_depthwise_16bit(dtype):
    x, w = rand((1, 8, 15, 19), dtype), rand((8, 1, 3, 3), dtype)
    want = F.conv2d(x.float(), w.float(), None, 2, 1, 1, 8).to(dtype)
    assert_close(kiln.ops.conv2d(x, w, None, 2, 1, 1, 8), want, atol=2e-2, rtol=2e-2)


GROUPED = [
    ((1, 8, 9, 9), (8, 4, 3, 3), dict(groups=2, padding=1)),
    ((2, 8, 13, 11), (16, 1, 3, 3), dict(groups=8, stride=2, padding=1)),        # a channel multiplier of 2
    ((1, 12, 10, 14), (45, 4, 3, 3), dict(groups=3, padding=1)),                   # 15 channels a group
    ((1, 36, 7, 9), (42, 12, 1, 1), dict(groups=3)),                               # grouped 1x1
    ((2, 8, 14, 14), (12, 4, 1, 1), dict(groups=2)),                               # read in place
    ((2, 64, 9, 9), (96, 2, 3, 3), dict(groups=32, padding=1, dilation=(1, 2))),
]


@pytest.mark.parametrize("xs, ws, kw", GROUPED)
def test_grouped_convolutions(xs, ws, kw):
    """The GEMM's batches are (image, group) pairs: each group's planes, weight and channels."""
    x, w, b = rand(xs), rand(ws), rand((ws[0],))
    assert schedules_for(_task(kiln.from_torch(x), kiln.from_torch(w), kiln.from_torch(b), **kw), "cpu")[0] is conv_cpu.TEMPLATE
    assert_close(kiln.ops.conv2d(x, w, b, **kw), F.conv2d(x, w, b, **kw), atol=1e-4, rtol=1e-4)
    symbolic = kiln.symbol(list(xs))                      # the weight laid out once, per group
    compiled = kiln.trace_from(kiln.ops.conv2d(symbolic, kiln.from_torch(w), kiln.from_torch(b), **kw), [symbolic]).compile()
    assert compiled.steps[0].kernel.kernel.program.entry == "kiln_kernel_prepared"
    assert_close(compiled.run([x])[0], F.conv2d(x, w, b, **kw), atol=1e-4, rtol=1e-4)


class _InvertedResidual(nn.Module):
    """MobileNetV2's block: 1x1 expansion, ReLU6, 3x3 depthwise, ReLU6, 1x1 projection, residual."""

    def __init__(self, c, hidden):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(c, hidden, 1, bias=False), nn.BatchNorm2d(hidden), nn.ReLU6(),
                                  nn.Conv2d(hidden, hidden, 3, 1, 1, groups=hidden, bias=False),
                                  nn.BatchNorm2d(hidden), nn.ReLU6(), nn.Conv2d(hidden, c, 1, bias=False),
                                  nn.BatchNorm2d(c))

    def forward(self, x):
        return x + self.body(x)


def test_inverted_residual_fuses_into_the_depthwise_template():
    torch.manual_seed(0)
    block = _InvertedResidual(6, 18).eval()
    for bn in block.body[1::3]:
        bn.running_mean.uniform_(-1, 1), bn.running_var.uniform_(0.5, 2), bn.weight.data.uniform_(0.5, 2)
    capture, _ = compile_and_compare(block, torch.randn(1, 6, 11, 10))
    graph = next(iter(capture.compiled[0].graphs.values())).graph
    fused = [n for n in graph.nodes if type(n).__name__ == "FusedOperator" and n.task.name == "conv2d"]
    assert sum(conv_depthwise_cpu.TEMPLATE.applies(n.task) for n in fused) == 1
    assert sum(gemm_cpu.CONV.applies(n.task) for n in fused) == 3


class _Block(nn.Module):
    """A ResNet basic block with a stride-2 first convolution and a 1x1 downsampling skip."""

    def __init__(self, cin, cout):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(cin, cout, 3, 2, 1, bias=False), nn.BatchNorm2d(cout)
        self.conv2, self.bn2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
        self.skip = nn.Sequential(nn.Conv2d(cin, cout, 1, 2, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu6(self.bn2(self.conv2(y)) + self.skip(x))


@pytest.mark.parametrize("batch", [1, 2])     # regression: fusion zeroes a batch index of extent 1
def test_resnet_block_epilogues_fuse_into_the_template(batch):
    torch.manual_seed(0)
    block = _Block(5, 12).eval()
    for bn in (block.bn1, block.bn2, block.skip[1]):
        bn.running_mean.uniform_(-1, 1), bn.running_var.uniform_(0.5, 2), bn.weight.data.uniform_(0.5, 2)
    capture, _ = compile_and_compare(block, torch.randn(batch, 5, 15, 13))
    graph = next(iter(capture.compiled[0].graphs.values())).graph
    fused = [n for n in graph.nodes if type(n).__name__ == "FusedOperator" and n.task.name == "conv2d"]
    taken = [n for n in fused if conv_cpu.TEMPLATE.applies(n.task)]
    assert len(taken) == 2 and any(len(n.task.inputs) >= 4 for n in taken)     # weight, bias, input, residual


_ASAN_MAIN = r"""
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
void kiln_kernel(const float*, const float*, const float*, float*);
void kiln_kernel_prepared(const float*, const float*, const float*, float*, const float*);
int64_t kiln_prepare(const float*, const float*, const float*, float*, float*);
int main(int argc, char** argv) {
    long nx = atol(argv[1]), nw = atol(argv[2]), nb = atol(argv[3]), no = atol(argv[4]);
    float *x = malloc(nx * 4), *w = malloc(nw * 4), *b = malloc(nb * 4), *o = malloc(2 * no * 4);
    for (long i = 0; i < nx; ++i) x[i] = (float)(i % 13) * 0.1f - 0.6f;
    for (long i = 0; i < nw; ++i) w[i] = (float)(i % 7) * 0.1f - 0.3f;
    for (long i = 0; i < nb; ++i) b[i] = (float)(i % 5);
    kiln_kernel(x, w, b, o);
#ifdef PREPARED                 /* the weight laid out once */
    float* u = aligned_alloc(64, (kiln_prepare(NULL, w, NULL, NULL, NULL) * 4 + 63) / 64 * 64);
    kiln_prepare(NULL, w, NULL, NULL, u);
    kiln_kernel_prepared(x, w, b, o + no, u);
#else
    for (long i = 0; i < no; ++i) o[no + i] = o[i];
#endif
    FILE* f = fopen(argv[5], "wb");
    fwrite(o, 4, 2 * no, f);
    fclose(f);
    return 0;
}
"""


def _pattern(shape, mod, scale, shift):
    return ((torch.arange(torch.Size(shape).numel()) % mod).float() * scale - shift).reshape(shape)


@pytest.mark.parametrize("xs, ws, kw, isa", [
    ((2, 5, 13, 21), (5, 1, 3, 3), dict(stride=2, padding=1, dilation=(1, 2), groups=5), []),
    ((1, 3, 7, 40), (3, 1, 3, 3), dict(padding=1, groups=3), ["-mno-avx512f"]),
    ((1, 2, 5, 1500), (2, 1, 3, 3), dict(padding=1, groups=2), ["-mno-avx512f"]),     # staged 2, 2 and 1 rows
])
def test_depthwise_is_clean_under_address_sanitizer(tmp_path, xs, ws, kw, isa):
    _sanitized(tmp_path, conv_depthwise_cpu, xs, ws, kw, isa)


@pytest.mark.parametrize("xs, ws, kw, isa", [
    ((2, 5, 13, 11), (7, 5, 3, 3), dict(stride=2, padding=1, dilation=(2, 1)), []),
    ((1, 9, 6, 5), (40, 9, 3, 3), dict(padding=1), []),                                    # gathered
    ((1, 9, 6, 5), (40, 9, 3, 3), dict(padding=1), ["-mno-avx512f"]),
    ((1, 3, 19, 17), (10, 3, 5, 5), dict(stride=2, padding=2), ["-mno-avx"]),
    ((2, 6, 7, 7), (20, 6, 3, 3), dict(padding=1), []),                                     # aligned
    ((1, 4, 33, 32), (6, 4, 3, 3), dict(stride=2, padding=1), ["-mno-avx512f"]),
    ((1, 200, 7, 7), (96, 200, 1, 1), {}, ["-mno-avx512f"]),                               # 1x1
    ((2, 12, 10, 14), (45, 4, 3, 3), dict(groups=3, padding=1), []),                         # grouped
    ((1, 36, 7, 9), (42, 12, 1, 1), dict(groups=3), ["-mno-avx512f"]),
    ((2, 200, 14, 14), (64, 200, 1, 1), {}, []),                                             # read in place
    ((1, 200, 12, 12), (64, 200, 1, 1), {}, ["-mno-avx512f"]),                               # AVX2's 6 rows
    ((3, 200, 14, 14), (64, 200, 1, 1), {}, ["-mno-avx512f"]),             # in place but the last image (virtual pixels)
    ((3, 8, 14, 14), (12, 4, 1, 1), dict(groups=2), ["-mno-avx512f"]),
    ((3, 5, 9, 12), (7, 5, 3, 3), {}, ["-mno-avx512f"]),
    ((2, 8, 14, 14), (12, 4, 1, 1), dict(groups=2), []),
    ((1, 5, 16, 15), (9, 5, 3, 2), {}, []),
    ((2, 5, 9, 6), (7, 5, 3, 3), {}, []),
    ((1, 6, 11, 20), (10, 6, 1, 3), dict(stride=2, padding=(0, 1)), []),                     # one phase along h
])
def test_kernels_are_clean_under_address_sanitizer(tmp_path, xs, ws, kw, isa):
    _sanitized(tmp_path, conv_cpu, xs, ws, kw, isa)


def _sanitized(tmp_path, template, xs, ws, kw, isa):
    x, w, b = _pattern(xs, 13, 0.1, 0.6), _pattern(ws, 7, 0.1, 0.3), _pattern((ws[0],), 5, 1.0, 0.0)
    want = F.conv2d(x, w, b, **kw)
    task = _task(kiln.from_torch(x), kiln.from_torch(w), kiln.from_torch(b), **kw)
    program = template.render(task, **template.TEMPLATE.space(0)[0])
    run_sanitized(tmp_path, program.source, _ASAN_MAIN, [x.numel(), w.numel(), b.numel(), want.numel(), tmp_path / "out.bin"],
                  [*isa, *(["-DPREPARED"] if program.preparation else [])])
    out = torch.frombuffer(bytearray((tmp_path / "out.bin").read_bytes()), dtype=torch.float32).reshape(2, *want.shape)
    assert_close(out, want.expand(2, *want.shape), atol=1e-4, rtol=1e-4)
