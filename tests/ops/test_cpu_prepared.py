"""Constant GEMM operands laid out once (`kiln.runtime.cpu.Preparation`): weights of linears,
matmuls and convolutions that are constants of a graph are packed into the CPU templates'
panels when the graph compiles, and the kernels read them from there. Against PyTorch on odd
shapes (no multiple of a panel or block), non-contiguous and 16-bit constants, batches, fused
epilogues and symbolic sizes (the C under AddressSanitizer: test_cpu_templates)."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import kiln
from kiln_ops_builtin.templates import conv_cpu
from tests.frontend.frontend_support import Capture, compile_and_compare
from tests.support import assert_close, rand


def _compiled(build, example, constants):
    """`build(x, *constants)` traced over a symbolic x like `example` with Kiln constants, compiled."""
    x = kiln.symbol(list(example.shape), example.dtype)
    return kiln.trace_from(build(x, *[kiln.from_torch(c) for c in constants]), [x]).compile()


def _entries(compiled) -> list[str]:
    return [step.kernel.kernel.program.entry for step in compiled.steps]


@pytest.mark.parametrize("m, k, n", [(37, 70, 53), (5, 1000, 129), (130, 257, 33), (1, 1000, 77), (3, 19, 40)])
def test_linear_weight_packed_once(m, k, n):
    """K = 1000 runs in several K blocks, each reading its rows of the laid-out panels; up to
    4 rows stream the panels once."""
    w, b, x = rand((n, k)), rand((n,)), rand((1, m, k))
    compiled = _compiled(kiln.ops.linear, x, [w, b])
    assert _entries(compiled) == ["kiln_kernel_prepared"]
    prepared = compiled.constants[compiled.steps[0].inputs[-1]]
    assert prepared.dtype == torch.float32 and prepared.numel() >= n * k
    for x in (x, rand((1, m, k))):        # the same laid-out weight serves every call
        # against float64: float32 sums of 1000 products of values in [-3, 3] are off by up
        # to ~1.5e-4 (torch's own as much)
        want = F.linear(x.double(), w.double(), b.double()).float()
        assert_close(compiled.run([x])[0], want, atol=5e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16bit_weights_are_laid_out_in_float32(dtype):
    w, x = rand((45, 67), dtype, -1, 1), rand((33, 67), dtype, -1, 1)
    compiled = _compiled(lambda x, w: kiln.ops.matmul(x, kiln.ops.transpose(w, 0, 1)), x, [w])
    assert "kiln_kernel_prepared" in _entries(compiled)
    assert_close(compiled.run([x])[0], x @ w.t(), atol=2e-2, rtol=2e-2)


def test_non_contiguous_constants():
    """A column-strided weight and a transposed one: laid out from their values, not their memory."""
    w = rand((70, 2 * 41))[:, ::2]                 # 70 x 41, strided
    wt = rand((41, 70)).t()                        # 70 x 41, column-major
    x = rand((29, 70))
    assert not w.is_contiguous() and not wt.is_contiguous()
    compiled = _compiled(lambda x, w, wt: kiln.ops.matmul(x, w) + kiln.ops.matmul(x, wt), x, [w, wt])
    assert _entries(compiled).count("kiln_kernel_prepared") == 2
    assert_close(compiled.run([x])[0], x @ w + x @ wt, atol=1e-4, rtol=1e-4)


def test_a_graphs_weights_prepared_at_once_on_torchs_threads_equal_those_prepared_one_by_one(monkeypatch):
    from kiln.runtime import plan, threads as runtime_threads

    monkeypatch.setattr(runtime_threads, "AT_ONCE", 0)        # threads for these few bytes too
    calls = []
    monkeypatch.setattr(plan, "ThreadPoolExecutor", lambda n, make=plan.ThreadPoolExecutor: calls.append(n) or make(n))
    ws, x = [rand((70, 41 + 8 * k)) for k in range(4)], rand((29, 70))
    build = lambda x, *ws: [kiln.ops.matmul(x, w) for w in ws]
    threads = torch.get_num_threads()
    try:
        forms = []
        for count in (4, 1):
            torch.set_num_threads(count)
            # fresh weights each time: a weight's form, once prepared, is reused
            compiled = _compiled(lambda x, *ws: kiln.ops.concat(build(x, *ws), 1), x, [w.clone() for w in ws])
            assert _entries(compiled).count("kiln_kernel_prepared") == len(ws)
            assert torch.get_num_threads() == count, "the caller's threads stay as they were"
            forms.append([compiled.constants[step.inputs[-1]] for step in compiled.steps
                          if step.kernel.kernel.program.entry == "kiln_kernel_prepared"])
            assert_close(compiled.run([x])[0], torch.cat([x @ w for w in ws], 1), atol=1e-4, rtol=1e-4)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(*forms)) and calls and calls[0] > 1


def test_a_graph_prepared_in_the_calling_thread_leaves_torchs_threads_as_they_were():
    w, x = rand((70, 53)), rand((29, 70))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        _compiled(kiln.ops.matmul, x, [w])
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


def test_a_weight_read_by_two_steps_prepared_at_once_is_laid_out_once(monkeypatch):
    from kiln.runtime import threads as runtime_threads

    monkeypatch.setattr(runtime_threads, "AT_ONCE", 0)
    w, x = rand((70, 53)), rand((29, 70))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        compiled = _compiled(lambda x, w: kiln.ops.concat([kiln.ops.matmul(x, w), kiln.ops.matmul(x * 2.0, w)], 1),
                             x, [w])
    finally:
        torch.set_num_threads(threads)
    forms = [compiled.constants[step.inputs[-1]] for step in compiled.steps
             if step.kernel.kernel.program.entry == "kiln_kernel_prepared"]
    assert len(forms) == 2 and forms[0] is forms[1]
    assert_close(compiled.run([x])[0], torch.cat([x @ w, (x * 2.0) @ w], 1), atol=1e-4, rtol=1e-4)


def test_batched_matmul_constant_broadcast_and_per_batch():
    """A B shared by every batch is laid out once; a B that differs by batch is not prepared."""
    shared, per_batch, x = rand((33, 45)), rand((3, 33, 45)), rand((3, 19, 33))
    for b, entry in ((shared, "kiln_kernel_prepared"), (per_batch, "kiln_kernel")):
        compiled = _compiled(kiln.ops.matmul, x, [b])
        assert _entries(compiled) == [entry]
        assert_close(compiled.run([x])[0], x @ b, atol=1e-4, rtol=1e-4)


def test_activations_as_b_are_not_prepared():
    """Constant A, activations as B (a 1x1 convolution's pixels): nothing to lay out."""
    w, x = rand((24, 37)), rand((37, 50))
    x_sym = kiln.symbol(list(x.shape))
    compiled = kiln.trace_from(kiln.ops.matmul(kiln.from_torch(w), x_sym), [x_sym]).compile()
    assert _entries(compiled) == ["kiln_kernel"]
    assert_close(compiled.run([x])[0], w @ x, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("shape, weight, kw", [
    ((1, 5, 13, 11), (37, 5, 3, 3), dict(padding=1)),
    ((2, 17, 11, 11), (9, 17, 5, 5), dict(stride=2, padding=2)),
    ((1, 7, 12, 12), (20, 7, 3, 3), dict(dilation=2, padding="same")),
])
def test_conv2d_weight_packed_once(shape, weight, kw):
    x, w, b = rand(shape), rand(weight), rand((weight[0],))
    compiled = _compiled(lambda x, w, b: kiln.ops.conv2d(x, w, b, **kw), x, [w, b])
    assert _entries(compiled) == ["kiln_kernel_prepared"]
    assert conv_cpu.TEMPLATE.applies(compiled.steps[0].kernel.task)
    assert_close(compiled.run([x])[0], F.conv2d(x, w, b, **kw), atol=1e-4, rtol=1e-4)


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 13, 3, padding=1)
        self.fc1, self.fc2 = nn.Linear(13, 67), nn.Linear(67, 13)

    def forward(self, x):
        h = F.relu(self.conv(x)).mean((2, 3))
        return self.fc2(F.gelu(self.fc1(h))) + h


def test_models_through_torch_compile_read_prepared_weights():
    """Epilogues fused around the prepared GEMMs (bias, activations, a residual)."""
    torch.manual_seed(0)
    capture, _ = compile_and_compare(_Block().eval(), torch.randn(5, 3, 9, 10))
    compiled = next(iter(capture.compiled[0].graphs.values())).graph.compile()
    assert _entries(compiled).count("kiln_kernel_prepared") == 3


def _prepared_forms(capture) -> list[set[int]]:
    """Per graph traced: the addresses of the prepared forms its steps read."""
    out = []
    for run in capture.compiled[0].graphs.values():
        compiled = run.graph.compile()
        out.append({compiled.constants[step.inputs[-1]].data_ptr() for step in compiled.steps
                    if step.kernel.kernel.program.entry == "kiln_kernel_prepared"})
    return out


def test_symbolic_rows_share_prepared_weights_which_follow_updates():
    """The graphs traced at each sequence length (one kernel serves them all, down to the few-row
    path, which reads the weight itself) share the laid-out weights; an in-place update of a
    weight, or new memory for it, lays it out anew."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(70, 53), nn.ReLU(), nn.Linear(53, 40)).eval()
    capture = Capture()
    compiled = torch.compile(model, backend=capture, dynamic=True)
    with torch.no_grad():
        for rows in (37, 2, 130):
            x = torch.randn(rows, 70)
            torch.testing.assert_close(compiled(x), model(x), atol=1e-4, rtol=1e-4)
        forms = _prepared_forms(capture)
        assert len(forms) == 3 and len(forms[0]) == 2 and forms[0] == forms[1] == forms[2]
        for update in (lambda: model[0].weight.mul_(-1.5),                  # a new version
                       lambda: setattr(model[2].weight, "data", torch.randn(40, 53))):   # new memory
            update()
            for rows in (37, 2):
                x = torch.randn(rows, 70)
                torch.testing.assert_close(compiled(x), model(x), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("threads", [1, 2])
def test_next_b_panel_prefetched_changes_no_bit(threads):
    """`GemmKnobs.B_PREFETCH` (the laid-out B panel read next prefetched while one computes)
    over several A blocks (M = 700, MC 336), K blocks and a tail (K = 1000, KC 256) and a part
    panel (N = 77), on one thread and on two (each prefetching its own panels): the bits of the
    kernel without it, and float64's values."""
    from kiln.runtime.cpu import CpuKernel
    from kiln_ops_builtin.templates import gemm_cpu

    x, w, b = rand((700, 1000)), rand((77, 1000)), rand((77,))
    op = kiln.ops.linear
    task, _, _ = op.task(op.bind((kiln.from_torch(x), kiln.from_torch(w), kiln.from_torch(b)), {}))
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        outs = []
        for prefetch in (0, 1):
            program = gemm_cpu.render(task, B_PREFETCH=prefetch)
            assert f"#define B_PREFETCH {prefetch}" in program.source
            kernel, form = CpuKernel(program).prepare([None, w, None])
            outs.append(torch.empty(700, 77))
            kernel([x, w, b, form], [outs[-1]])
    finally:
        torch.set_num_threads(saved)
    assert torch.equal(outs[0], outs[1])
    assert_close(outs[1], F.linear(x.double(), w.double(), b.double()).float(), atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("threads", [1, 2])
def test_images_inside_a_laid_out_weights_blocks_give_the_bits_of_one_image_at_a_time(threads):
    """With the weight laid out once and larger than an image's rows (35 pixels, 40 output
    channels: a part panel), a convolution's images (its GEMM batches) run inside each block of
    it (K = 96 x 9 = 864: K blocks, each image's partial sums kept apart); without, one image at
    a time. The sums are taken in the same order, so both give the same bits, and float64's values."""
    from kiln.runtime.cpu import CpuKernel

    x, w, b = rand((3, 96, 5, 7)), rand((40, 96, 3, 3)), rand((40,))
    op = kiln.ops.conv2d
    task, _, _ = op.task(op.bind((kiln.from_torch(x), kiln.from_torch(w), kiln.from_torch(b)), {"padding": 1}))
    assert conv_cpu.TEMPLATE.applies(task)
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        program = conv_cpu.TEMPLATE.render(task)
        kernel, form = CpuKernel(program).prepare([None, w, None])
        plain, prepared = torch.empty(3, 40, 5, 7), torch.empty(3, 40, 5, 7)
        CpuKernel(program)([x, w, b], [plain])
        kernel([x, w, b, form], [prepared])
    finally:
        torch.set_num_threads(saved)
    assert torch.equal(plain, prepared)
    want = F.conv2d(x.double(), w.double(), b.double(), padding=1).float()
    assert_close(prepared, want, atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("groups", [1, 2])
def test_conv2d_images_inside_the_weights_blocks(groups):
    """Three images of a 3x3 convolution over 96 channels (K = 864 / groups: K blocks where
    ungrouped) with 40 output channels (a part panel, more than an image's 35 pixels), its
    weight laid out once."""
    x, w, b = rand((3, 96, 5, 7)), rand((40, 96 // groups, 3, 3)), rand((40,))
    compiled = _compiled(lambda x, w, b: kiln.ops.conv2d(x, w, b, padding=1, groups=groups), x, [w, b])
    assert _entries(compiled) == ["kiln_kernel_prepared"]
    want = F.conv2d(x.double(), w.double(), b.double(), padding=1, groups=groups).float()
    assert_close(compiled.run([x])[0], want, atol=1e-3, rtol=1e-4)
