"""Peeled row kernels (`kiln.schedule.cuda_rows`): rows whose length or offsets are not multiples
of the pack (GPT-2's 50,257 logits a row) read and write aligned packs from `kiln_shift`
elements before the row, skipping the elements outside it. Without a GPU: the generated
source (packs, the shift, element-wise stores at the row's ends) and NVRTC compilation for
sm_80 and sm_90; `tests/cuda/test_rows_misaligned_cuda.py` compares the results on a GPU."""
import pytest
import torch

import kiln
from kiln.runtime import cuda as rt
from kiln.schedule.choose import auto_program

ops = kiln.ops
needs_nvrtc = pytest.mark.skipif(not rt.nvrtc_available(), reason="cuda-bindings / nvidia-cuda-nvrtc "
                                 "not installed: pip install 'kiln-core[cuda]'")


def _programs(outputs, inputs):
    """The CUDA programs of the optimized graph's tasks."""
    graph = kiln.graph.optimize(kiln.trace_from(outputs, inputs))
    return [auto_program(n.task, "cuda") for n in graph.nodes]


def _log_sum_exp(x):
    xf = ops.cast(x, torch.float32)
    high = ops.amax(xf, [1], True)
    return ops.add(ops.log(ops.sum(ops.exp(ops.sub(xf, high)), [1], True)), high)


def _log_softmax_backward(x, g):
    """d(x) of log_softmax(x) for d(out) = g: g - softmax(x) * sum(g), in x's type."""
    xf, gf = ops.cast(x, torch.float32), ops.cast(g, torch.float32)
    p = ops.exp(ops.log_softmax(xf, -1))
    return ops.cast(ops.sub(gf, ops.mul(p, ops.sum(gf, [1], True))), x.dtype)


def _cases():
    """(name, outputs, inputs, pack type): row tasks whose rows are not whole packs."""
    cases = []
    for dtype, pack in ((torch.bfloat16, "kiln_pack<uint16_t, 8>"), (torch.float32, "kiln_pack<float, 4>")):
        name = str(dtype).replace("torch.", "")
        x = kiln.symbol((5, 1027), dtype, "cuda")
        cases.append((f"log_softmax_{name}", ops.log_softmax(x, -1), [x], pack))
        x = kiln.symbol((64, 1027), dtype, "cuda")
        cases.append((f"softmax_{name}", ops.softmax(x, -1), [x], pack))
        x = kiln.symbol((256, 5003), dtype, "cuda")
        cases.append((f"log_sum_exp_{name}", _log_sum_exp(x), [x], pack))
        x, g = kiln.symbol((64, 5003), dtype, "cuda"), kiln.symbol((64, 5003), dtype, "cuda")
        cases.append((f"log_softmax_backward_{name}", _log_softmax_backward(x, g), [x, g], pack))
        wide = kiln.symbol((64, 1035), dtype, "cuda")      # columns 8.. : in the output's phase
        cases.append((f"offset_view_{name}", ops.softmax(ops.slice(wide, 1, 8, None), -1), [wide], pack))
    return cases


CASES = _cases()


@pytest.mark.parametrize("name, outputs, inputs, pack", CASES, ids=[c[0] for c in CASES])
def test_odd_rows_are_read_in_shifted_packs(name, outputs, inputs, pack):
    (program,) = [p for p in _programs(outputs, inputs) if "kiln_row" in p.kernel_names]
    src = program.source
    assert "kiln_shift" in src and f"const {pack} " in src, src
    assert program.alignment == 16
    if "log_sum_exp" not in name:
        assert f"*reinterpret_cast<{pack}*>(out0" in src          # whole packs stored at once,
        assert "< (uint64_t)" in src and "kiln_st.v[kiln_j];" in src   # the row's ends element by element
    else:
        assert "out0[o] =" in src


def test_a_log_sum_exp_over_a_vocabulary_walks_packs_of_a_block():
    """GPT-2's cross-entropy forward: bf16 logits [4096, 50257], one value a row."""
    x = kiln.symbol((4096, 50257), torch.bfloat16, "cuda")
    (program,) = _programs(_log_sum_exp(x), [x])
    src = program.source
    assert program.launches[0].block[0] > 32
    assert "const int kiln_shift = (int)((v1) & 7);" in src
    assert src.count("*reinterpret_cast<const kiln_pack<uint16_t, 8>*>") == 2    # max and sum, then sum again
    assert "in0[" not in src                                          # no scalar loads


def test_loads_out_of_the_outputs_phase_stay_scalar():
    """x[:, 1:] of [64, 1028]: the input's rows start one element later than the output's in
    their packs; the input is read element by element, the output still written in packs."""
    x = kiln.symbol((64, 1028), torch.bfloat16, "cuda")
    (program,) = [p for p in _programs(ops.softmax(ops.slice(x, 1, 1, None), -1), [x]) if "kiln_row" in p.kernel_names]
    assert "in0[" in program.source and "const kiln_pack<uint16_t, 8> " not in program.source


def test_aligned_rows_are_not_peeled():
    x = kiln.symbol((64, 1024), torch.bfloat16, "cuda")
    (program,) = _programs(ops.log_softmax(x, -1), [x])
    assert "kiln_shift" not in program.source and "kiln_pack<uint16_t, 8>" in program.source


@needs_nvrtc
def test_peeled_rows_compile_with_nvrtc():
    jobs = [(p.source, f"{name}_{k}", arch) for name, outputs, inputs, _ in CASES
            for k, p in enumerate(_programs(outputs, inputs)) for arch in ("sm_80", "sm_90")]
    rt.compile_many(jobs, workers=2)
