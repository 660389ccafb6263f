"""Online maxima and sums of exponentials in row kernels (`kiln.schedule.rows.online_sums`,
`kiln.schedule.cuda_rows`): a row its statistics cannot keep in registers (cross-entropy's
log-sum-exp over GPT-2's 50,257 logits) is read once for its maximum and its sum of
exp(x - maximum) together, and again only where the maximum is not finite. Without a GPU: which
statistics pair up, the generated source, NVRTC compilation for sm_80 and sm_90;
`tests/cuda/test_rows_misaligned_cuda.py` compares the results on a GPU."""
import pytest
import torch

import kiln
from kiln.ir.inline import inline_task
from kiln.runtime import cuda as rt
from kiln.schedule.choose import auto_program
from kiln.schedule.rows import online_sums, row_form, row_task, run_of_reductions

ops = kiln.ops
needs_nvrtc = pytest.mark.skipif(not rt.nvrtc_available(), reason="cuda-bindings / nvidia-cuda-nvrtc "
                                 "not installed: pip install 'kiln-core[cuda]'")


def _tasks(outputs, inputs):
    return [n.task for n in kiln.graph.optimize(kiln.trace_from(outputs, inputs)).nodes]


def _log_sum_exp(x, zero=None):
    """log(sum(exp(x - c))) + c of x's rows in float32, c the row's maximum (or, as aten's
    logsumexp decomposes, the scalar `zero` where the maximum is infinite)."""
    xf = ops.cast(x, torch.float32)
    high = ops.amax(xf, [1], True)
    if zero is not None:
        high = ops.where(ops.isinf(high), zero, high)
    return ops.add(ops.log(ops.sum(ops.exp(ops.sub(xf, high)), [1], True)), high)


def _zero():
    return kiln.symbol((), torch.float32, "cuda")


def _pairs(task):
    """online_sums of a row task (its reductions walked as the row where it writes one value
    a row): {statistic: the reduction's op}."""
    lowered = inline_task(task)
    form = row_form(lowered, *row_task(lowered))
    e, stats = form.e, form.stats
    if form.row_len == 1:
        e, stats, _ = run_of_reductions(form, 1)
    return {k: r.op for k, r in online_sums(stats, form.scalars, e).items()}


@pytest.mark.parametrize("guarded", (False, True))
def test_a_maximum_pairs_with_the_sum_of_exponentials_shifted_by_it(guarded):
    x, zero = kiln.symbol((64, 1027), torch.bfloat16, "cuda"), _zero()
    (task,) = _tasks(_log_sum_exp(x, zero if guarded else None), [x, zero])
    assert _pairs(task) == {0: "sum"}
    (task,) = _tasks(ops.log_softmax(x, -1), [x])
    assert _pairs(task) == {0: "sum"}


def test_sums_of_other_exponentials_do_not_pair():
    x, y = kiln.symbol((64, 1027), torch.float32, "cuda"), kiln.symbol((64, 1027), torch.float32, "cuda")
    high = ops.amax(x, [1], True)
    other = ops.sum(ops.exp(ops.sub(y, high)), [1], True)             # exp of another tensor
    (task,) = _tasks(ops.add(ops.mul(x, other), high), [x, y])
    assert _pairs(task) == {}
    mean = ops.mean(x, [1], True)
    shifted = ops.sum(ops.exp(ops.sub(x, mean)), [1], True)           # shifted by another statistic
    (task,) = _tasks(ops.add(ops.mul(x, shifted), high), [x])
    assert _pairs(task) == {}


def test_a_sum_shifted_by_a_later_statistic_does_not_pair():
    """exp(x - max - s), s a statistic that reads the maximum: the one pass over the row
    cannot know s yet."""
    x = kiln.symbol((64, 1027), torch.float32, "cuda")
    high = ops.amax(x, [1], True)
    s = ops.sum(ops.mul(x, high), [1], True)
    total = ops.sum(ops.exp(ops.sub(x, ops.add(high, s))), [1], True)
    (task,) = _tasks(ops.mul(x, total), [x])
    assert _pairs(task) == {}


def _source(outputs, inputs):
    (program,) = [auto_program(t, "cuda") for t in _tasks(outputs, inputs)]
    return program.source


def test_a_vocabulary_log_sum_exp_reads_its_row_once_where_the_maximum_is_finite():
    """GPT-2's cross-entropy forward: bf16 logits [4096, 50257], one value a row."""
    x, zero = kiln.symbol((4096, 50257), torch.bfloat16, "cuda"), _zero()
    src = _source(_log_sum_exp(x, zero), [x, zero])
    online, fallback = src.split("fabsf(hi2) != INFINITY)")
    assert online.count("const kiln_pack<uint16_t, 8> ") == 1 and "in0[" not in online
    assert fallback.count("const kiln_pack<uint16_t, 8> ") == 1      # the sum again, for a maximum of +-inf/NaN


def test_rows_kept_in_registers_take_two_passes_over_them():
    x = kiln.symbol((64, 1024), torch.bfloat16, "cuda")
    src = _source(ops.softmax(x, -1), [x])
    assert "kiln_xs" not in src and "kiln_x0" in src


def _online_cases():
    """Row tasks whose statistics take the online pass: bf16 and float32, a block a row (long
    rows, peeled or not) and a warp a row (three streams do not fit the registers)."""
    cases = []
    for dtype in (torch.bfloat16, torch.float32):
        name = str(dtype).replace("torch.", "")
        x, zero = kiln.symbol((256, 50257), dtype, "cuda"), _zero()
        cases.append((f"log_sum_exp_50257_{name}", _log_sum_exp(x, zero), [x, zero]))
        x = kiln.symbol((64, 65536), dtype, "cuda")
        cases.append((f"softmax_65536_{name}", ops.softmax(x, -1), [x]))
        x, y, z = (kiln.symbol((64, 1024), dtype, "cuda") for _ in range(3))
        cases.append((f"log_softmax_sum_warp_{name}", ops.log_softmax(ops.add(ops.add(x, y), z), -1), [x, y, z]))
    return cases


CASES = _online_cases()


@pytest.mark.parametrize("name, outputs, inputs", CASES, ids=[c[0] for c in CASES])
def test_long_rows_take_the_online_pass(name, outputs, inputs):
    src = _source(outputs, inputs)
    assert "kiln_xs" in src and "__fmul_rn(" in src, src
    assert ("__shared__ float shm" in src) == ("warp" not in name)


@needs_nvrtc
def test_online_rows_compile_with_nvrtc():
    jobs = [(auto_program(t, "cuda").source, f"{name}_{k}", arch) for name, outputs, inputs in CASES
            for k, t in enumerate(_tasks(outputs, inputs)) for arch in ("sm_80", "sm_90")]
    rt.compile_many(jobs, workers=2)
