"""The Hopper attention template (`attention_sm90`) without a GPU: which attention tasks it takes
and which it leaves to attention_flash and attention_decode, its tensor maps ([B, H, L, D] and
[B, L, H, D] layouts, grouped-query heads, a packed projection's offset), its ranking (before
attention_flash, on sm_90 only), its level-0 choices, one source for the lengths of a bucket,
and every knob setting of its level-2 space compiled with NVRTC for sm_90a (both 16-bit types,
head dims 64 to 128, bool and float masks, causal, grouped-query heads, lengths that are no
multiple of the tiles, [B, L, H, D] views); the operator on the CPU under KILN_NVRTC_CHECK."""
import pytest
import torch

import kiln
from kiln import dtypes
from kiln.ir import Task, TensorInput, compute
from kiln.runtime import cuda as rt
from kiln.runtime.cuda import TensorMapArg
from kiln.schedule import schedules_for
from kiln_ops_builtin import attention as attention_op
from kiln_ops_builtin.templates import attention_flash, attention_sm90

from tests.cuda.attention_support import attention_task, blhd_task, reference
from tests.cuda.symbolic_cases import CASES as SYMBOLIC

needs_nvrtc = pytest.mark.skipif(not rt.nvrtc_available(), reason="cuda-bindings / nvidia-cuda-nvrtc "
                                 "not installed: pip install 'kiln-core[cuda]'")
f16, bf16 = dtypes.float16, dtypes.bfloat16


def _task(q=(2, 4, 70, 64), k=(2, 2, 175, 64), *args, **kwargs):
    return attention_task(q, k, *args, **kwargs)


def _maps(task, knobs=None):
    launch = attention_sm90.render(task, **(knobs or attention_sm90.TEMPLATE.space(0)[0])).launches[0]
    return [a for a in launch.args if isinstance(a, TensorMapArg)]


def test_takes_prefill_and_declines_the_rest():
    for d in attention_sm90.HEAD_DIMS:
        for t in (f16, bf16):
            assert attention_sm90.applies(_task((2, 4, 70, d), (2, 2, 175, d), dtype=t))
    assert attention_sm90.applies(_task((1, 4, 64, 64), (1, 4, 129, 64), causal=True, mask=((64, 129), dtypes.boolean)))
    assert not attention_sm90.applies(_task((1, 4, 64, 64), (1, 4, 128, 64)))          # one key tile: attention_flash's
    assert not attention_sm90.applies(_task((2, 4, 63, 64), (2, 2, 4096, 64)))          # decoding: attention_decode's
    assert not attention_sm90.applies(_task(dtype=dtypes.float32))
    assert not attention_sm90.applies(_task((2, 4, 70, 48), (2, 2, 175, 48)))
    assert not attention_sm90.applies(_task((2, 4, 70, 64), (2, 2, 175, 64), (2, 2, 175, 128)))   # Dv != D
    four = _task((2, 2, 2, 2, 70, 64), (2, 2, 2, 2, 175, 64))       # four batch dims: a tensor map has five at most
    assert attention_flash.applies(four) and not attention_sm90.applies(four)


def test_tensor_maps_read_operands_in_place():
    q, k, v = _maps(_task((2, 4, 70, 64), (2, 2, 75, 64)))
    assert (q.dims, q.strides, q.box) == ((64, 70, 4, 2), (1, 64, 70 * 64, 4 * 70 * 64), (64, 128, 1, 1))
    assert (k.dims, k.strides) == ((64, 75, 2, 2), (1, 64, 75 * 64, 2 * 75 * 64))      # the key/value heads h // 2
    assert v.box == (64, 128, 1, 1) and q.offset == k.offset == 0
    q, k, _ = _maps(blhd_task(2, 150, 8, 2, 96, f16, True))                          # [B, L, H, D] views
    assert (q.dims, q.strides) == ((96, 150, 8, 2), (1, 8 * 96, 96, 150 * 8 * 96))
    assert (k.dims, k.strides) == ((96, 150, 2, 2), (1, 2 * 96, 96, 150 * 2 * 96))
    source = attention_sm90.render(blhd_task(2, 150, 8, 2, 96, f16, True), **attention_sm90.TEMPLATE.space(0)[0]).source
    assert "Batch<2> k_batch(PARAMS) { return {{{1, 8, 4}, {8, 2, 1}}}; }" in source   # key/value head h // 4, b
    # the queries of a packed [B, L, 3 * H * D] projection: the map starts at the queries' offset
    src, k_in, v_in = TensorInput("qkv", (2, 70, 768), f16), *(TensorInput(n, (2, 4, 70, 64), f16) for n in "kv")
    q_view = compute((2, 4, 70, 64), lambda b, h, i, e: src[b, i, 256 + h * 64 + e])
    task = Task("attention", [src, k_in, v_in], [attention_op.attention.definition(q_view, k_in, v_in, None, None,
                                                                                    False)], {})
    q, _, _ = _maps(task)
    assert (q.dims, q.strides, q.offset) == ((64, 70, 4, 2), (1, 768, 64, 70 * 768), 256)
    with pytest.raises(ValueError, match="offset 4"):                          # 8 bytes: no TMA start address
        TensorMapArg("in0", f16, (64, 70), (1, 64), (64, 64), offset=4)


def test_ranked_before_attention_flash_and_on_sm90_only():
    task = _task((2, 4, 200, 128), (2, 4, 200, 128), causal=True)
    names = [t.name for t in schedules_for(task, "cuda", 90)]
    assert names.index("attention_sm90") < names.index("attention_flash")
    assert "attention_sm90" not in [t.name for t in schedules_for(task, "cuda", 80)]
    program = attention_sm90.render(task, **attention_sm90.TEMPLATE.space(0)[0])
    assert (program.min_arch, program.arch_for("sm_90")) == (90, "sm_90a")


def test_space_fits_and_invalid_knobs_raise():
    Knobs = attention_sm90.AttentionSm90Knobs
    for level in (0, 1, 2):
        for knobs in Knobs.space(level):
            assert knobs.fits(), knobs
            assert knobs.smem_bytes(128) <= attention_sm90.MAX_SMEM
    assert not Knobs(BN=176, CW=2, STAGES=3).fits()                            # shared memory at head dim 128
    assert Knobs(BN=176, CW=2, STAGES=3).fits(64)
    with pytest.raises(ValueError, match="unsupported setting"):
        Knobs(BN=72, CW=2, STAGES=2)                                          # no whole k16 step of keys
    with pytest.raises(ValueError, match="does not fit head dim 128"):
        attention_sm90.render(_task((2, 4, 70, 128), (2, 4, 70, 128)), BN=176, CW=2, STAGES=3)


def test_level0_choice():
    suggest = lambda *shapes, **kw: attention_sm90.suggest(_task(*shapes, **kw), 132)[0]
    assert suggest((1, 32, 2048, 128), (1, 32, 2048, 128), causal=True) == {"BN": 128, "CW": 2, "STAGES": 2}
    assert suggest((2, 16, 2048, 96), (2, 16, 2048, 96)) == {"BN": 176, "CW": 2, "STAGES": 2}
    assert suggest((8, 12, 128, 64), (8, 12, 128, 64)) == {"BN": 128, "CW": 1, "STAGES": 2}   # 96 blocks of 128
    # 128 blocks of 128 queries (the Llama-style 1B at 512 tokens): 97% of the SMs, two consumers
    # (9.5 against 11.8 us for 256 blocks of 64 on an H200)
    assert suggest((1, 32, 512, 64), (1, 8, 512, 64), causal=True)["CW"] == 2
    assert suggest((2, 16, 2048, 128), (2, 16, 2048, 128), mask=((2048, 2048), dtypes.boolean))["BN"] == 128


TASKS = {
    "d64_causal_gqa_bool_mask": dict(q=(2, 4, 200, 64), k=(2, 2, 200, 64), mask=((2, 1, 200, 200), dtypes.boolean),
                                     causal=True),
    "d128_bf16_float_mask_lq_gt_lk": dict(q=(1, 2, 333, 128), k=(1, 2, 200, 128), dtype=bf16,
                                          mask=((1, 2, 333, 200), bf16)),
    "d96_causal_lq_lt_lk": dict(q=(1, 3, 130, 96), k=(1, 3, 333, 96), causal=True),
    "d80_bf16_gqa_no_heads_lead": dict(q=(8, 70, 80), k=(2, 75, 80), dtype=bf16),
}


@needs_nvrtc
@pytest.mark.parametrize("name", list(TASKS) + ["blhd_views"])
def test_every_knob_compiles(name):
    task = blhd_task(2, 150, 8, 2, 128, f16, True) if name == "blhd_views" else _task(**TASKS[name])
    programs = [attention_sm90.render(task, **k) for k in attention_sm90.TEMPLATE.space(2)]
    assert all("wgmma.mma_async.sync.aligned.m64n" in p.source and "setmaxnreg" in p.source for p in programs)
    rt.compile_many([(p.source, f"attention_sm90_{name}", p.arch_for("sm_90")) for p in programs], workers=2)


@needs_nvrtc
def test_lengths_of_a_bucket_share_one_source():
    """The causal prefill over [B, L, H, D] views at a symbolic length: one source for 70, 100
    and 128 queries (the tensor maps and the grid are the run's), which compiles."""
    case = next(c for c in SYMBOLIC if c.name == "attention_prefill")
    programs = []
    for n in (150, 200, 256):
        task = next(node.task for node in case.graph(n).nodes if attention_sm90.applies(node.task))
        programs.append(attention_sm90.render(task, **attention_sm90.suggest(task, 132)[0]))
    assert len({p.source for p in programs}) == 1 and [p.sizes for p in programs] == [(150,), (200,), (256,)]
    assert [[a.dims[1] for a in p.launches[0].args if isinstance(a, TensorMapArg)] for p in programs] == \
        [[150] * 3, [200] * 3, [256] * 3]
    rt.compile_many([(programs[0].source, "attention_sm90_symbolic", "sm_90a")])


@needs_nvrtc
def test_operator_on_cpu_under_nvrtc_check(monkeypatch):
    """The attention operator on the CPU with every program Kiln may build for it (this
    template's among them) compiled for sm_80 and sm_90."""
    monkeypatch.setenv("KILN_NVRTC_CHECK", "sm_80,sm_90")
    q, k, v = (torch.randn(1, h, 170, 64, dtype=torch.float16) for h in (4, 2, 2))
    assert attention_sm90.applies(_task((1, 4, 170, 64), (1, 2, 170, 64), causal=True))
    out = kiln.ops.attention(q, k, v, is_causal=True).torch()
    torch.testing.assert_close(out.double(), reference(q, k, v, is_causal=True), atol=1e-2, rtol=1e-2)
