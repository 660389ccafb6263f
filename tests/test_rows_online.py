"""Online maxima and sums of exponentials in row kernels (`kiln.schedule.rows.online_sums`,
`kiln.schedule.cuda_rows`): a row its statistics cannot keep in registers (cross-entropy's
log-sum-exp over GPT-2's 50,257 logits) is read once for its maximum and its sum of
exp(x - maximum) together, and again only where the maximum is not finite. Without a GPU: which
statistics pair up, the generated source, NVRTC compilation for sm_80 and sm_90;
`tests/cuda/test_rows_misaligned_cuda.py` compares the results on a GPU."""
import re

import pytest
import torch

import kiln
from kiln.ir.inline import inline_task
from kiln.runtime import cuda as rt
from kiln.schedule.choose import auto_program
from kiln.schedule.cuda_kernels import BLOCK, TARGET_BLOCKS
from kiln.schedule.cuda_rows import ONLINE_GROUP_PACKS, ONLINE_LANES, online_groups, online_plan, plan_row
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
    assert online.count("*reinterpret_cast<const kiln_pack<uint16_t, 8>*>") == 1 and "in0[" not in online
    assert fallback.count("const kiln_pack<uint16_t, 8> ") == 1      # the sum again, for a maximum of +-inf/NaN


def test_rows_kept_in_registers_take_two_passes_over_them():
    x = kiln.symbol((64, 1024), torch.bfloat16, "cuda")
    src = _source(ops.softmax(x, -1), [x])
    assert "kiln_xs" not in src and "kiln_x0" in src


def _online_cases():
    """Row tasks whose statistics take the online pass: bf16 and float32, a block a row (long
    rows, peeled or not, few rows and many) and a warp a row (three streams do not fit the
    registers)."""
    cases = []
    for dtype in (torch.bfloat16, torch.float32):
        name = str(dtype).replace("torch.", "")
        for rows in (256, 4096):        # GPT-2's 4096 rows take narrower blocks (cuda_rows.online_plan)
            x, zero = kiln.symbol((rows, 50257), dtype, "cuda"), _zero()
            cases.append((f"log_sum_exp_{rows}x50257_{name}", _log_sum_exp(x, zero), [x, zero]))
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


def _group_pass(src):
    """The online pass of a row kernel's source: (the group's loads, the group's reduction and
    the lanes' fold), split where the group's values begin and where the row's pass ends."""
    body = src[src.index("for (int kiln_g = 0;"):src.index("fabsf(hi")]
    loads, rest = body.split("float kiln_xs", 1)
    return loads, rest


@pytest.mark.parametrize("name, outputs, inputs", CASES, ids=[c[0] for c in CASES])
def test_the_online_pass_loads_a_group_of_packs_before_using_any(name, outputs, inputs):
    """Each thread issues its group's 16-byte loads one after another, independent of each
    other and of the running maximum, and reads no memory while it reduces them."""
    loads, rest = _group_pass(_source(outputs, inputs))
    assert re.search(r"kiln_pack<\w+, \d> pk\d+\[4\];", loads), loads
    assert re.findall(r"pk\d+\[kiln_u\] = \*reinterpret_cast<const kiln_pack<", loads), loads
    assert "expf(" not in loads and "kiln_max_f" not in loads
    assert "reinterpret_cast" not in rest and "in0[" not in rest


def test_a_block_folds_its_warps_online_pairs_as_a_warp():
    """The (maximum, sum) pairs of a block's warps: five shuffle folds a warp, not a loop of
    one fold a warp of the block (two exponentials each)."""
    x, zero = kiln.symbol((4096, 50257), torch.bfloat16, "cuda"), _zero()
    online = _source(_log_sum_exp(x, zero), [x, zero]).split("fabsf(hi")[0]
    assert "kiln_w" not in online and online.count("for (int kiln_m = 16;") == 2
    assert "? shm" in online


@pytest.mark.parametrize("rows", (4096, 96))
@pytest.mark.parametrize("row_len, vector, peeled", ((50257, 8, True), (50257, 4, True), (65536, 8, False)))
def test_online_rows_make_whole_groups(rows, row_len, vector, peeled):
    """A thread's chunks are whole groups of packs, over every pack of the row; many rows take
    at most ONLINE_LANES threads each, few keep the lanes that fill the GPU."""
    plan = plan_row(row_len, vector, 4 * vector, reduced=row_len, peeled=peeled)
    fitted = online_plan(plan, rows)
    packs = -(-(row_len + (vector - 1 if peeled else 0)) // vector)
    assert not fitted.cached and fitted.guarded == (peeled or fitted.lanes * fitted.chunks * vector > row_len)
    assert fitted.chunks % ONLINE_GROUP_PACKS == 0
    assert fitted.lanes * fitted.chunks >= packs > fitted.lanes * (fitted.chunks - ONLINE_GROUP_PACKS)
    assert online_groups(fitted) == (ONLINE_GROUP_PACKS, fitted.chunks // ONLINE_GROUP_PACKS)
    assert fitted.lanes <= (ONLINE_LANES if rows * ONLINE_LANES >= TARGET_BLOCKS * BLOCK else plan.lanes)


def test_a_warp_row_keeps_its_plan():
    plan = plan_row(2048, 8, 96)
    assert plan.warp and not plan.cached and online_plan(plan, 4096) is plan
