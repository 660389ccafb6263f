"""Choosing schedules (`kiln.schedule`): one query over templates and the auto-scheduler's rules
for every target, CPU templates included; the runtime backend table; build settings; the GPU
architecture parsed as a number."""
import pytest
import torch

import kiln
from kiln.codegen.emitter import KernelArgs
from kiln.plugins.registry import registry
from kiln.runtime.backend import BACKENDS, backend_for
from kiln.runtime.cpu import CpuProgram
from kiln.runtime.cuda import CudaProgram, arch_number
from kiln.schedule import AUTO_RULES, Template, schedules_for, templates_for
from kiln.schedule.choose import auto_program


def _task(op, *args, **kwargs):
    definition = registry().operator(op)
    return definition.task(definition.bind(args, kwargs))[0]


@pytest.mark.parametrize("name,number", [("sm_80", 80), ("sm_90", 90), ("sm_90a", 90), ("sm_100", 100),
                                         ("sm_100a", 100), ("sm_120", 120), (" sm_86 ", 86)])
def test_architecture_is_parsed_as_a_number(name, number):
    assert arch_number(name) == number


@pytest.mark.parametrize("name", ["90", "sm_", "compute_90", "sm_9x"])
def test_a_malformed_architecture_is_refused(name):
    with pytest.raises(ValueError, match="architecture"):
        arch_number(name)


def test_templates_for_newer_gpus_are_not_skipped():
    task = _task("matmul", torch.randn(256, 128, dtype=torch.float16), torch.randn(128, 256, dtype=torch.float16))
    names = [t.name for t in schedules_for(task, "cuda", arch_number("sm_100"))]
    assert "matmul_wgmma" in names and names == [t.name for t in schedules_for(task, "cuda", 90)]
    assert "matmul_wgmma" not in [t.name for t in schedules_for(task, "cuda", 80)]


def test_backend_is_a_table_lookup_on_the_device_kind():
    assert set(BACKENDS) == {"cpu", "cuda"}
    assert backend_for(kiln.device("cpu")) is BACKENDS["cpu"]
    assert backend_for(kiln.device("cuda")) is BACKENDS["cuda"]


def test_backend_refuses_another_targets_program():
    program = CudaProgram("", [])
    with pytest.raises(TypeError, match="CpuProgram"):
        BACKENDS["cpu"].load(program, kiln.device("cpu"))


def test_a_program_is_loaded_once_per_process():
    task = _task("relu", torch.randn(3, 5))
    first, second = auto_program(task, "cpu"), auto_program(task, "cpu")
    assert first == second and first is not second
    cpu = kiln.device("cpu")
    assert BACKENDS["cpu"].load(first, cpu) is BACKENDS["cpu"].load(second, cpu)


def test_auto_rules_are_tried_in_order():
    rules = [r.__module__ for r in AUTO_RULES["cuda"]]
    assert rules == ["kiln.schedule.cuda_columns", "kiln.schedule.cuda_transpose", "kiln.schedule.cuda_rows",
                     "kiln.schedule.cuda_split", "kiln.schedule.cuda_general"]
    columns = auto_program(_task("sum", torch.randn(5000, 40), 0), "cuda")
    assert [launch.kernel for launch in columns.launches] == ["kiln_k0_columns", "kiln_k0"]
    softmax = auto_program(_task("softmax", torch.randn(256, 100), -1), "cuda")
    assert [launch.kernel for launch in softmax.launches] == ["kiln_row"]
    transpose = auto_program(_task("permute", torch.randn(64, 96), [1, 0]), "cuda")
    assert [launch.kernel for launch in transpose.launches] == ["kiln_transpose"]
    total = auto_program(_task("sum", torch.randn(1 << 17)), "cuda")
    assert [launch.kernel for launch in total.launches] == ["kiln_k0_split", "kiln_k0"]
    plain = auto_program(_task("relu", torch.randn(33, 7)), "cuda")
    assert [launch.kernel for launch in plain.launches] == ["kiln_k0"]


def _doubling_relu(task, SCALE=2):
    """A CPU template that computes SCALE * relu(x): visibly not the auto-scheduler's relu."""
    (x,), (out,) = task.inputs, task.outputs
    n = 1
    for s in x.shape:
        n *= s
    params = ", ".join(KernelArgs.params(kiln.codegen.c.CDialect(), task.inputs, task.outputs))
    source = (f"#include <stdint.h>\nvoid doubling_relu({params}) {{\n"
              f"    for (int64_t i = 0; i < {n}; ++i) {KernelArgs.output(0)}[i] = "
              f"{KernelArgs.input(0)}[i] > 0 ? {SCALE} * {KernelArgs.input(0)}[i] : 0;\n}}\n")
    return CpuProgram(source, "doubling_relu", tuple(KernelArgs.args(1, 1)))


@pytest.fixture
def cpu_template(monkeypatch):
    template = Template("doubling_relu", ("relu",), "cpu", _doubling_relu, priority=5,
                        applies=lambda task: task.inputs[0].dtype == kiln.dtypes.float32,
                        space=lambda level: [{"SCALE": 2}])
    reg = registry()
    items = reg.items
    monkeypatch.setattr(reg, "items", lambda kind: items(kind) + ([template] if kind == "schedules" else []))
    return template


def test_cpu_templates_are_consulted(cpu_template):
    x = torch.randn(6, 7)
    task = _task("relu", x)
    assert templates_for("relu", "cpu") == [cpu_template] and schedules_for(task, "cpu") == [cpu_template]
    assert schedules_for(task, "cuda") == []
    out = kiln.ops.relu(kiln.from_torch(x)).torch()
    torch.testing.assert_close(out, 2 * torch.relu(x))


def test_a_cpu_template_that_declines_leaves_the_task_to_the_auto_scheduler(cpu_template):
    x = torch.randn(6, 7, dtype=torch.float64)
    assert schedules_for(_task("relu", x), "cpu") == []
    torch.testing.assert_close(kiln.ops.relu(kiln.from_torch(x)).torch(), torch.relu(x))


def test_kernel_args_own_the_argument_names():
    x, y = torch.randn(2, 3), torch.randn(3)
    assert KernelArgs.args(2, 1) == [KernelArgs.input(0), KernelArgs.input(1), KernelArgs.output(0)]
    bound = KernelArgs.bind([x, y], [x], [y])
    assert bound == {KernelArgs.input(0): x.data_ptr(), KernelArgs.input(1): y.data_ptr(),
                     KernelArgs.output(0): x.data_ptr(), KernelArgs.temporary(0): y.data_ptr()}


def test_template_source_puts_knobs_after_hooks_and_before_kernels():
    from kiln.codegen import ptx
    from kiln.codegen.cuda import CUDA_PRELUDE, template_source
    source = template_source(["KERNEL_A", "KERNEL_B"], {"BM": 64, "LOAD(v)": "(v)"}, "HOOKS", (ptx.CP_ASYNC,))
    assert source == CUDA_PRELUDE + ptx.CP_ASYNC + "HOOKS#define BM 64\n#define LOAD(v) (v)\nKERNEL_AKERNEL_B"


def test_mma_wrapper_names_its_operand_type():
    from kiln.codegen import ptx
    assert ptx.mma_m16n8k16(kiln.dtypes.bfloat16) == "kiln_mma_m16n8k16_bf16"
    assert "kiln_mma_m16n8k16_bf16(" in ptx.MMA and "kiln_mma_m16n8k16_f16(" in ptx.MMA
    with pytest.raises(ValueError, match="float32"):
        ptx.mma_m16n8k16(kiln.dtypes.float32)


@pytest.mark.parametrize("a,b", [((1, 128), (128, 333)), ((2, 8, 1, 64), (2, 8, 64, 40)), ((5, 128), (128, 1))])
def test_a_single_row_or_column_is_still_a_contraction(a, b):
    """M = 1 (decoding) and N = 1 matmuls reach the GEMM templates: the size-1 index, simplified
    to the constant 0, used to make `match_contraction` give up."""
    from kiln.codegen.hooks import match_contraction
    x, y = (kiln.from_torch(torch.randn(s)) for s in (a, b))
    c = match_contraction(_task("matmul", x, y))
    assert c is not None and (c.M, c.N, c.K) == (a[-2], b[-1], a[-1])
    assert c.a.k_stride == 1 and c.b.k_stride == (1 if b[-1] == 1 else b[-1])


def test_cpu_kernels_with_and_without_a_status_buffer():
    """A CPU kernel whose program checks nothing is called without a status buffer (the
    common case, every step of a model), one that checks its indices with one: both compute,
    and the second still raises on a bad index, before and after the first has run."""
    from kiln.runtime.cpu import CpuKernel
    from kiln.schedule.choose import choose
    x, w, ids = torch.randn(5, 7), torch.randn(7, 3), torch.tensor([2, 0, 4])
    plain = CpuKernel(choose(_task("matmul", kiln.from_torch(x), kiln.from_torch(w)), "cpu"))
    checked = CpuKernel(choose(_task("embedding", kiln.from_torch(ids), kiln.from_torch(x)), "cpu"))
    assert KernelArgs.STATUS not in plain.program.args and KernelArgs.STATUS in checked.program.args
    for _ in range(2):
        out = torch.empty(5, 3)
        plain([x, w], [out])
        torch.testing.assert_close(out, x @ w)
        rows = torch.empty(3, 7)
        checked([ids, x], [rows])
        torch.testing.assert_close(rows, x[ids])
        with pytest.raises(IndexError, match="out of range"):
            checked([torch.tensor([1, 9, 0]), x], [rows])
