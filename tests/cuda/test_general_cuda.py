"""The CUDA auto-scheduler's general rule (`kiln.schedule.cuda_general`) and the row rule's short
rows (`kiln.schedule.cuda_rows.SHORT_ROW`): fewer launches for small tasks.

Consecutive injective outputs none of which reads another share one kernel, each under its own
bound; an output reading another, a reduction, or two different symbolic sizes keep kernels
apart. Few short rows (a decode step's 8 RMSNorm rows) take one row kernel instead of a
statistics kernel and an output kernel. Without a GPU: the kernels chosen and NVRTC; with one
(`cuda`): results against PyTorch."""
import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.ir import SymSize, Task, TensorInput, compute
from kiln.ir.expr import cast, exp, reduce
from kiln.runtime import cuda as rt
from kiln.runtime.backend import backend_for
from kiln.schedule.choose import auto_program
from tests.cuda.test_rows_cuda import OPS, _row_call, _task
from tests.support import assert_close, rand

needs_nvrtc = pytest.mark.skipif(not rt.nvrtc_available(), reason="cuda-bindings / nvidia-cuda-nvrtc "
                                 "not installed: pip install 'kiln-core[cuda]'")


def _three_outputs(rows=5, cols=7):
    """exp(x), twice x's first row (fewer elements) and x's elements as int64 (flat): three
    injective outputs of different sizes and dtypes, none reading another."""
    x = TensorInput("x", (rows, cols), "float32")
    a = compute([rows, cols], lambda i, j: exp(x[i, j]), name="a")
    b = compute([cols], lambda j: x[0, j] * 2.0, name="b")
    c = compute([rows * cols], lambda i: cast(x[i // cols, i % cols] * 100.0, "int64"), name="c")
    return Task("three", [x], [a, b, c])


def _reads_an_output():
    """exp(x) and its transpose plus one: the second output reads the first at other indices."""
    x = TensorInput("x", (5, 7), "float32")
    a = compute([5, 7], lambda i, j: exp(x[i, j]), name="a")
    d = compute([7, 5], lambda i, j: a[j, i] + 1.0, name="d")
    return Task("reads", [x], [a, d])


def _after_a_reduction():
    """exp(x), its column sums, x times the sums: an injective output after a reduction."""
    x = TensorInput("x", (5, 7), "float32")
    a = compute([5, 7], lambda i, j: exp(x[i, j]), name="a")
    s = compute([7], lambda j: reduce([5], lambda r: x[r, j]), name="s")
    e = compute([5, 7], lambda i, j: x[i, j] * s[j], name="e")
    return Task("reduced", [x], [a, s, e])


def _two_symbolic_sizes(n=6, m=6):
    """x * 2 over s0 rows and y + 1 over s1 rows: equal at this trace, not at others."""
    s0, s1 = SymSize.named("s0", n), SymSize.named("s1", m)
    x, y = TensorInput("x", (s0, 4), "float32"), TensorInput("y", (s1, 4), "float32")
    a = compute([s0, 4], lambda i, j: x[i, j] * 2.0, name="a")
    b = compute([s1, 4], lambda i, j: y[i, j] + 1.0, name="b")
    return Task("two_sizes", [x, y], [a, b])


def _kernels(task):
    return [launch.kernel for launch in auto_program(task, "cuda").launches]


def test_injective_outputs_share_one_kernel():
    program = auto_program(_three_outputs(), "cuda")
    assert [launch.kernel for launch in program.launches] == ["kiln_k0"]
    assert program.launches[0].items == 35
    assert "if (o < 7)" in program.source and "if (o < 35)" not in program.source


def test_outputs_that_read_outputs_or_follow_reductions_keep_their_kernels():
    assert _kernels(_reads_an_output()) == ["kiln_k0", "kiln_k1"]
    assert len(_kernels(_after_a_reduction())) == 3


def test_different_symbolic_sizes_keep_their_kernels():
    assert _kernels(_two_symbolic_sizes()) == ["kiln_k0", "kiln_k1"]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("rows,n", [(3, 7), (8, 2048), (2, 8192)])
def test_few_short_rows_take_one_row_kernel(op, rows, n):
    assert _kernels(_task(op, (rows, n), torch.float16)) == ["kiln_row"]


@pytest.mark.parametrize("op", OPS)
def test_few_long_rows_keep_the_general_kernels(op):
    assert _kernels(_task(op, (3, 8193), torch.float16)) != ["kiln_row"]


@needs_nvrtc
def test_merged_and_short_row_kernels_compile():
    tasks = [_three_outputs(), _reads_an_output(), _after_a_reduction(), _two_symbolic_sizes(),
             _task("rms_norm", (8, 2048), torch.bfloat16), _task("softmax", (3, 1001), torch.float32)]
    rt.compile_many([(auto_program(t, "cuda").source, t.name, arch) for t in tasks for arch in ("sm_80", "sm_90")],
                    workers=2)


def _run(task, inputs):
    device = kiln.device("cuda")
    runner = backend_for(device).load(auto_program(task, "cuda"), device)
    outputs = [torch.full(tuple(map(int, o.shape)), -7, dtype=o.dtype.torch_dtype, device="cuda")
               for o in task.outputs]
    runner(inputs, outputs)
    return outputs


@pytest.mark.cuda
@pytest.mark.parametrize("rows,cols", [(5, 7), (33, 65), (1, 1)])
def test_injective_outputs_in_one_kernel_match_torch(rows, cols):
    x = rand((rows, cols), torch.float32).cuda()
    a, b, c = _run(_three_outputs(rows, cols), [x])
    assert_close(a, torch.exp(x))
    assert_close(b, x[0] * 2.0)
    assert torch.equal(c, (x * 100.0).to(torch.int64).flatten())


@pytest.mark.cuda
def test_kept_kernels_match_torch():
    x = rand((5, 7), torch.float32).cuda()
    a, d = _run(_reads_an_output(), [x])
    assert_close(d, torch.exp(x).T + 1.0)
    a, s, e = _run(_after_a_reduction(), [x])
    assert_close(s, x.sum(0))
    assert_close(e, x * x.sum(0))


@pytest.mark.cuda
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("shape", [(3, 7), (8, 2048), (2, 4, 1001), (2, 8192), (3, 8193)])
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=lambda d: str(d).replace("torch.", ""))
def test_few_rows_match_torch(op, shape, dtype):
    x = rand(shape, dtype).cuda()
    torch.manual_seed(1)                       # layer_norm's weights, the same for both calls
    actual, expected = _row_call(op, x)
    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 and op in ("layer_norm", "rms_norm") else {}
    assert_close(actual, expected, **tol)
    torch.manual_seed(1)
    assert_close(_row_call(op, x.transpose(-1, -2).contiguous().transpose(-1, -2))[0], expected, **tol)
