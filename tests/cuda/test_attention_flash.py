"""The fused attention template (`attention_flash`) on a GPU against torch's
scaled_dot_product_attention in float64: every head dim, both 16-bit types, causal, bool and
float masks, grouped-query heads, lengths that are no multiple of the tiles, [B, L, H, D]
views read in place, fully masked rows, a fused epilogue, and every level-1 knob setting."""
import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.ir import Task, TensorInput, compute
from kiln.passes.fused import fold_anchor
from kiln.plugins.registry import registry
from kiln_ops_builtin import attention as attention_op
from kiln_ops_builtin.templates import attention_flash
from kiln_ops_builtin.templates.attention_match import match_attention

from tests.cuda.attention_support import bias_epilogue_task, blhd_task as _blhd_task, load_template, tensor_task

pytestmark = pytest.mark.cuda

TOL = {torch.float16: 1e-2, torch.bfloat16: 4e-2}


def _reference(q, k, v, mask=None, causal=False, scale=None):
    """sdpa in float64 (key/value heads repeated for grouped-query attention); rows whose keys
    are all masked give zeros, as the attention operator defines."""
    group = q.shape[-3] // k.shape[-3]
    k64, v64 = (t.double().repeat_interleave(group, dim=-3) for t in (k, v))
    m = mask if mask is None or mask.dtype == torch.bool else mask.double()
    out = F.scaled_dot_product_attention(q.double(), k64, v64, attn_mask=m, is_causal=causal, scale=scale)
    if mask is not None and mask.dtype == torch.bool:
        dead = ~mask.expand(*q.shape[:-1], k.shape[-2]).any(-1, keepdim=True)
        out = torch.where(dead, torch.zeros_like(out), out)
    return out


def _randn(*shape, dtype):
    return torch.randn(shape, device="cuda", dtype=torch.float32).to(dtype)


def _check(out, expected, dtype):
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), expected, atol=TOL[dtype], rtol=TOL[dtype])


def _run_op(q, k, v, mask=None, causal=False, scale=None):
    """attention_flash's program for the operator's task on these inputs, by name (on sm_90
    attention_sm90 ranks first beyond one key tile)."""
    task = tensor_task(q, k, v, mask, causal, scale)
    assert attention_flash.applies(task)
    knobs = attention_flash.suggest(task, torch.cuda.get_device_properties(0).multi_processor_count)[0]
    return load_template(attention_flash, task, knobs)([q, k, v] + ([mask] if mask is not None else []))


CASES = {
    "plain": dict(b=2, hq=3, hkv=3, lq=77, lk=131),
    "causal_gqa": dict(b=2, hq=8, hkv=2, lq=200, lk=200, causal=True),
    "causal_lq_lt_lk": dict(b=1, hq=4, hkv=1, lq=70, lk=150, causal=True),
    "bool_mask": dict(b=2, hq=4, hkv=2, lq=65, lk=97, mask="bool"),
    "float_mask": dict(b=2, hq=2, hkv=2, lq=130, lk=70, mask="float", scale=0.3),
}


def _inputs(b, hq, hkv, lq, lk, d, dtype, mask=None, causal=False, scale=None):
    q, k, v = _randn(b, hq, lq, d, dtype=dtype), _randn(b, hkv, lk, d, dtype=dtype), _randn(b, hkv, lk, d, dtype=dtype)
    m = None
    if mask == "bool":
        m = torch.rand(b, 1, lq, lk, device="cuda") > 0.3
    elif mask == "float":
        m = _randn(b, hq, lq, lk, dtype=dtype)
    return q, k, v, m, causal, scale


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("d", attention_flash.HEAD_DIMS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_matches_sdpa(case, d, dtype):
    q, k, v, m, causal, scale = _inputs(**CASES[case], d=d, dtype=dtype)
    _check(_run_op(q, k, v, m, causal, scale), _reference(q, k, v, m, causal, scale), dtype)


def test_fully_masked_rows_give_zeros():
    q, k, v, _, _, _ = _inputs(2, 4, 4, 90, 70, 64, torch.float16)
    mask = torch.rand(2, 4, 90, 70, device="cuda") > 0.5
    mask[:, :, 5] = False
    mask[1, 2, 80:] = False
    out = _run_op(q, k, v, mask)
    assert (out[:, :, 5] == 0).all() and (out[1, 2, 80:] == 0).all()
    _check(out, _reference(q, k, v, mask), torch.float16)


@pytest.mark.parametrize("lq", [1, 5, 16])
@pytest.mark.parametrize("d", [64, 128])
def test_decode_splits_keys(lq, d):
    q, k, v = _randn(3, 8, lq, d, dtype=torch.float16), _randn(3, 2, 1100, d, dtype=torch.float16), \
        _randn(3, 2, 1100, d, dtype=torch.float16)
    mask = torch.rand(3, 1, 1, 1100, device="cuda") > 0.2           # key padding
    mask[2] = False                                                  # a sequence with no keys: zeros
    definition = registry().operator("attention")
    task = definition.task(definition.bind([kiln.from_torch(t) for t in (q, k, v)], {"mask": kiln.from_torch(mask)}))[0]
    knobs = attention_flash.suggest(task, 132)[0]
    assert knobs.get("SPLIT", 1) > 1
    out = load_template(attention_flash, task, knobs)([q, k, v, mask])   # by name: attention_decode applies too
    assert (out[2] == 0).all()
    _check(out, _reference(q, k, v, mask), torch.float16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_blhd_views_read_in_place(dtype):
    task = _blhd_task(2, 150, 8, 2, 96, kiln.dtypes.data_type(dtype), True)
    match = match_attention(task)
    assert match.q.row_stride == 8 * 96 and match.k.row_stride == 2 * 96
    q, k, v = _randn(2, 150, 8, 96, dtype=dtype), _randn(2, 150, 2, 96, dtype=dtype), _randn(2, 150, 2, 96, dtype=dtype)
    out = load_template(attention_flash, task, attention_flash.suggest(task, 132)[0])([q, k, v])
    expected = _reference(*(t.transpose(1, 2) for t in (q, k, v)), causal=True)
    _check(out, expected, dtype)




def test_fused_epilogue_renders_into_the_hooks():
    task = bias_epilogue_task((2, 4, 100, 64))
    assert attention_flash.applies(task)
    tq, tk, tv, tb = (_randn(*s, dtype=torch.float16) for s in ((2, 4, 100, 64),) * 3 + ((64,),))
    out = load_template(attention_flash, task, attention_flash.suggest(task, 132)[0])([tq, tk, tv, tb])
    _check(out, (_reference(tq, tk, tv, causal=True).half() * 2 + tb).double(), torch.float16)


def test_output_reshaped_to_heads_times_dim():
    """attention(..).transpose(1, 2).reshape(B, L, H * D) folded in: the epilogue stores each
    value at its place in [B, L, H * D], pairs of neighbours packed."""
    f16 = kiln.dtypes.float16
    q, k, v = (TensorInput(n, (2, 4, 100, 64), f16) for n in "qkv")
    att = attention_op.attention.definition(q, k, v, None, None, True)
    out = compute((2, 100, 256), lambda b, i, c: att[b, c // 64, i, c % 64])
    task = Task("attention", [q, k, v], [fold_anchor(out, att)], {"is_causal": True})
    assert attention_flash.applies(task)
    tq, tk, tv = (_randn(2, 4, 100, 64, dtype=torch.float16) for _ in range(3))
    got = load_template(attention_flash, task, attention_flash.suggest(task, 132)[0])([tq, tk, tv])
    _check(got, _reference(tq, tk, tv, causal=True).transpose(1, 2).reshape(2, 100, 256), torch.float16)


@pytest.mark.parametrize("knobs", attention_flash.TEMPLATE.space(1), ids=lambda k: "-".join(map(str, k.values())))
@pytest.mark.parametrize("case", ["causal_gqa", "bool_mask", "float_mask"])
def test_every_level1_knob(knobs, case):
    dtype = torch.bfloat16 if case == "float_mask" else torch.float16
    d = 80 if case == "bool_mask" else 128
    q, k, v, m, causal, scale = _inputs(**CASES[case], d=d, dtype=dtype)
    definition = registry().operator("attention")
    args = definition.bind([kiln.from_torch(t) for t in (q, k, v)],
                           {"mask": None if m is None else kiln.from_torch(m), "scale": scale, "is_causal": causal})
    task = definition.task(args)[0]
    out = load_template(attention_flash, task, knobs)([q, k, v] + ([m] if m is not None else []))
    _check(out, _reference(q, k, v, m, causal, scale), dtype)

