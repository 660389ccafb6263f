"""The fused attention template (`attention_flash`) without a GPU: which attention tasks it takes
and which it leaves to the auto-scheduler, the strides it reads views with, its level-0
choices, and every knob setting compiled with NVRTC for sm_80 and sm_90 (each head dim, both
16-bit types, masks, causal, grouped-query heads); the operator itself on the CPU under
KILN_NVRTC_CHECK, which compiles every program Kiln may build for its task."""
import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln import dtypes
from kiln.ir import Task, TensorInput, compute
from kiln.passes.fused import fold_anchor
from kiln.runtime import cuda as rt
from kiln_ops_builtin import attention as attention_op
from kiln_ops_builtin.templates import attention_flash
from kiln_ops_builtin.templates.attention_match import match_attention

from tests.cuda.attention_support import attention_task

needs_nvrtc = pytest.mark.skipif(not rt.nvrtc_available(), reason="cuda-bindings / nvidia-cuda-nvrtc "
                                 "not installed: pip install 'kiln-core[cuda]'")
f16, bf16 = dtypes.float16, dtypes.bfloat16


def _task(q=(2, 4, 70, 64), k=(2, 2, 75, 64), *args, **kwargs):
    return attention_task(q, k, *args, **kwargs)


def test_takes_16bit_head_dims_it_supports():
    for d in attention_flash.HEAD_DIMS:
        for t in (f16, bf16):
            assert attention_flash.applies(_task((2, 4, 70, d), (2, 2, 75, d), dtype=t))
    assert not attention_flash.applies(_task(dtype=dtypes.float32))
    assert not attention_flash.applies(_task((2, 4, 70, 48), (2, 2, 75, 48)))
    assert not attention_flash.applies(_task((2, 4, 70, 64), (2, 2, 75, 64), (2, 2, 75, 128)))   # Dv != D


def test_reads_masks_scale_causal_and_groups():
    a = match_attention(_task(mask=((2, 1, 1, 75), dtypes.boolean), causal=True, scale=0.5))
    assert (a.mask, a.causal, a.scale, a.group, a.batch, a.Lq, a.Lk) == ("bool", True, 0.5, 2, (2, 4), 70, 75)
    assert "kiln_mask" in a.hooks and "kiln_epilogue2" in a.hooks
    a = match_attention(_task(mask=((70, 75), f16)))
    assert a.mask == "float" and a.scale == 0.125
    assert a.k.coef == {"b0": 2 * 75 * 64, "hkv": 75 * 64} and a.q.coef == {"b0": 4 * 70 * 64, "b1": 70 * 64}
    assert a.k.base(a.batch, a.group, "bh") == "(((bh) / 1 % 4) / 2) * (int64_t)4800 + ((bh) / 4 % 2) * (int64_t)9600"


def _view_task(view, shape, d=64):
    """Attention whose q is `view` (a function of an input of `shape` and the index) fused in."""
    src = TensorInput("src", shape, f16)
    q = compute((2, 4, 70, d), lambda b, h, i, e: view(src, b, h, i, e))
    k, v = TensorInput("k", (2, 4, 70, d), f16), TensorInput("v", (2, 4, 70, d), f16)
    return Task("attention", [src, k, v], [attention_op.attention.definition(q, k, v, None, None, False)], {})


def test_views_are_read_in_place_or_declined():
    # [B, L, H, D] transposed: rows at H * D
    a = match_attention(_view_task(lambda s, b, h, i, e: s[b, i, h, e], (2, 70, 4, 64)))
    assert a.q.row_stride == 256 and a.q.coef == {"b0": 70 * 256, "b1": 64} and a.q.offset == 0
    # heads split from a packed projection [B, L, 3 * H * D], the second third
    a = match_attention(_view_task(lambda s, b, h, i, e: s[b, i, 256 + h * 64 + e], (2, 70, 768)))
    assert a.q.row_stride == 768 and a.q.offset == 256 and a.q.coef == {"b0": 70 * 768, "b1": 64}
    # an odd offset cannot be copied in 16-byte chunks; a strided column is no row of D elements
    assert match_attention(_view_task(lambda s, b, h, i, e: s[b, i, h * 64 + e + 3], (2, 70, 300))) is None
    assert match_attention(_view_task(lambda s, b, h, i, e: s[b, i, h, e * 2], (2, 70, 4, 128))) is None
    # a computed operand (a fused prologue) is left to the auto-scheduler
    assert match_attention(_view_task(lambda s, b, h, i, e: s[b, h, i, e] * 2.0, (2, 4, 70, 64))) is None


def test_level0_choice():
    assert attention_flash.suggest(_task((8, 12, 128, 64), (8, 12, 128, 64)), 132)[0] == \
        {"BM": 64, "BN": 64, "NW": 4, "SPLIT": 1}
    assert attention_flash.suggest(_task((4, 32, 4096, 128), (4, 8, 4096, 128), causal=True), 132)[0]["BM"] == 128
    # decoding: 256 (batch, head) pairs split 5 ways for eight CTAs a multiprocessor
    assert attention_flash.suggest(_task((8, 32, 1, 128), (8, 8, 4096, 128)), 132)[0] == \
        {"BM": 64, "BN": 64, "NW": 4, "SPLIT": 5}
    assert attention_flash.suggest(_task((8, 32, 1, 128), (8, 8, 512, 128)), 132)[0]["SPLIT"] == 1


def test_split_kv_program_combines_partials():
    program = attention_flash.render(_task((2, 4, 3, 64), (2, 2, 1000, 64)), BM=64, BN=64, NW=4, SPLIT=4)
    assert [launch.kernel for launch in program.launches] == ["kiln_attention_flash", "kiln_attention_combine"]
    assert program.launches[0].grid == (4 * 8, 1, 1)
    assert program.temporaries == [((4, 8, 3, 64), dtypes.float32), ((4, 8, 3, 2), dtypes.float32)]


def test_space_is_valid():
    for level in (0, 1, 2):
        for knobs in attention_flash.TEMPLATE.space(level):
            assert attention_flash.FlashKnobs(**knobs).valid(), knobs
            assert attention_flash.smem_bytes(knobs["BM"], knobs["BN"], 128) <= attention_flash.MAX_SMEM
    assert attention_flash.TEMPLATE.space(0) == [attention_flash.FlashKnobs().as_dict()]
    assert not attention_flash.valid_tile(128, 64, 2)       # 64 rows a warp
    with pytest.raises(ValueError, match="FlashKnobs: unsupported setting"):
        attention_flash.render(_task(), BM=128, BN=64, NW=2)


TASKS = {
    "d64_bool_causal_gqa": dict(mask=((2, 1, 70, 75), dtypes.boolean), causal=True),
    "d80_bf16_float_mask": dict(q=(2, 4, 70, 80), k=(2, 4, 75, 80), dtype=bf16, mask=((4, 70, 75), bf16)),
    "d96_causal": dict(q=(1, 3, 33, 96), k=(1, 3, 40, 96), causal=True),
    "d128_bf16_gqa_no_heads_lead": dict(q=(8, 70, 128), k=(2, 75, 128), dtype=bf16),
}


@needs_nvrtc
@pytest.mark.parametrize("name", list(TASKS))
def test_every_knob_compiles(name):
    task = _task(**TASKS[name])
    programs = [attention_flash.render(task, **k) for k in attention_flash.TEMPLATE.space(2)]
    rt.compile_many([(p.source, f"attention_{name}", arch) for p in programs for arch in ("sm_80", "sm_90")])


@needs_nvrtc
def test_output_reshaped_to_heads_times_dim_compiles():
    """attention(..).transpose(1, 2).reshape(B, L, H * D) folded into the task: matched, the
    packed pair store kept (D even), every level-1 program compiles."""
    q, k, v = (TensorInput(n, (2, 4, 70, 64), f16) for n in "qkv")
    att = attention_op.attention.definition(q, k, v, None, None, False)
    out = compute((2, 70, 256), lambda b, i, c: att[b, c // 64, i, c % 64])
    task = Task("attention", [q, k, v], [fold_anchor(out, att)], {})
    assert attention_flash.applies(task) and "uint32_t*)&out0" in match_attention(task).hooks
    programs = [attention_flash.render(task, **k) for k in attention_flash.TEMPLATE.space(1)]
    rt.compile_many([(p.source, "attention_reshaped", arch) for p in programs for arch in ("sm_80", "sm_90")])


@needs_nvrtc
@pytest.mark.parametrize("queries,keys", [(20, 24), (2, 300)], ids=["prefill", "decode"])
def test_operator_on_cpu_under_nvrtc_check(monkeypatch, queries, keys):
    """The attention operator on the CPU, every program Kiln may build for it compiled for the
    GPU: a short prefill, and decoding (which `attention_decode` also takes)."""
    monkeypatch.setenv("KILN_NVRTC_CHECK", "sm_80,sm_90")
    q, k, v = (torch.randn(s, dtype=torch.float16)
               for s in ((1, 4, queries, 64), (1, 2, keys, 64), (1, 2, keys, 64)))
    mask = torch.rand(1, 1, queries, keys) > 0.3
    out = kiln.ops.attention(q, k, v, mask=mask).torch()
    expected = F.scaled_dot_product_attention(q.double(), k.double().repeat_interleave(2, 1),
                                              v.double().repeat_interleave(2, 1), attn_mask=mask)
    torch.testing.assert_close(out.double(), expected, atol=1e-2, rtol=1e-2)
