"""Tensor-core GEMMs of any K and any operand strides, without a GPU: operands that are not
K-contiguous in 16-byte aligned rows are staged (`kiln_ops_builtin.templates.stage`) instead of
leaving the GEMM to the auto-scheduler (GPT-2's LM-head gradient, K = 50,257, took 89 ms there on
an H200), which operands are staged, and the programs compiled with NVRTC for sm_90."""
import pytest
import torch

import kiln
from kiln.plugins.registry import registry
from kiln.runtime import cuda as rt
from kiln.schedule import schedules_for
from kiln_ops_builtin.templates import matmul_wgmma

needs_nvrtc = pytest.mark.skipif(not rt.nvrtc_available(), reason="cuda-bindings / nvidia-cuda-nvrtc "
                                 "not installed: pip install 'kiln-core[cuda]'")


def _task(op, *tensors):
    definition = registry().operator(op)
    return definition.task(definition.bind([kiln.from_torch(t) for t in tensors], {}))[0]


def _ones(*shape, dtype=torch.bfloat16):
    return torch.ones(shape, dtype=dtype)


CASES = {   # name: (task, staging kernels expected)
    "lm_head_grad": (lambda: _task("matmul", _ones(64, 50257), _ones(50257, 96)), ["kiln_stage_a", "kiln_stage_b"]),
    "odd_k_linear": (lambda: _task("linear", _ones(70, 37), _ones(45, 37), _ones(45)), ["kiln_stage_a", "kiln_stage_b"]),
    "odd_k_batched": (lambda: _task("matmul", _ones(3, 20, 13, dtype=torch.float16), _ones(3, 13, 24, dtype=torch.float16)),
                      ["kiln_stage_a", "kiln_stage_b"]),
    "row_major_b": (lambda: _task("matmul", _ones(64, 128), _ones(128, 96)), ["kiln_stage_b"]),
    "aligned": (lambda: _task("linear", _ones(64, 128), _ones(96, 128)), []),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_tensor_core_template_takes_every_k(name):
    make, staged = CASES[name]
    task = make()
    names = [t.name for t in schedules_for(task, "cuda", 90)]
    assert "matmul_wgmma" in names, names
    program = matmul_wgmma.render(task, **matmul_wgmma.TEMPLATE.space(0)[0])
    assert [launch.kernel for launch in program.launches][:-1] == staged
    assert program.launches[-1].kernel == "kiln_matmul_wgmma"


def test_staged_temporaries_are_padded_to_eight():
    program = matmul_wgmma.render(CASES["lm_head_grad"][0](), **matmul_wgmma.TEMPLATE.space(0)[0])
    assert [shape for shape, _ in program.temporaries] == [(1, 64, 50264), (1, 96, 50264)]


@needs_nvrtc
@pytest.mark.parametrize("name", list(CASES))
def test_staged_programs_compile(name):
    task = CASES[name][0]()
    programs = [matmul_wgmma.render(task, **knobs) for knobs in matmul_wgmma.TEMPLATE.space(1)]
    rt.compile_many([(rt.launch_source(p, "sm_90"), p.kernel_names[-1], p.arch_for("sm_90")) for p in programs])


def test_a_contraction_no_template_takes_is_logged(caplog):
    """float64 has no tensor-core or SIMT GEMM: the auto-scheduler's kernel runs it, with a warning."""
    from kiln.schedule import choose
    task = _task("matmul", _ones(64, 32, dtype=torch.float64), _ones(32, 16, dtype=torch.float64))
    with caplog.at_level("WARNING", logger="kiln"):
        choose(task, "cuda", 90)
    assert "no CUDA template takes matmul (64 x 16 x 32, float64 and float64" in caplog.text


def test_a_dot_product_left_to_the_auto_scheduler_is_not_logged(caplog):
    from kiln.schedule import choose
    task = _task("matmul", _ones(1, 768, dtype=torch.float32), _ones(768, 1, dtype=torch.float32))
    with caplog.at_level("WARNING", logger="kiln"):
        choose(task, "cuda", 90)
    assert "no CUDA template" not in caplog.text
