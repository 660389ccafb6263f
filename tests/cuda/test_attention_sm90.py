"""The Hopper attention template (`attention_sm90`) on an sm_90 GPU against torch's
scaled_dot_product_attention in float64, each error at most twice eager's own plus a little
(`attention_support.check_near_eager`): every head dim and both 16-bit types; query and key
lengths that are no multiple of the 64- and 128-row tiles (fewer queries than keys and more),
causal, grouped-query heads, bool and float masks, a scale; every knob setting of the level-2
space; fully masked rows (zeros); [B, L, H, D] views read in place; queries from a packed
projection (a tensor map from an offset); a fused epilogue; the lengths of a symbolic bucket on
one source. The tests render the template directly."""
import pytest
import torch

import kiln
from kiln.ir import Task, TensorInput, compute
from kiln_ops_builtin import attention as attention_op
from kiln_ops_builtin.templates import attention_sm90

from tests.cuda.attention_support import (bias_epilogue_task, blhd_task, check_near_eager, load_template, reference,
                                          tensor_task)
from tests.cuda.symbolic_cases import CASES as SYMBOLIC

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not HOPPER, reason="attention_sm90 needs an sm_90 GPU (wgmma, TMA)")]

CASES = {  # batch, query heads, key/value heads, queries, keys; mask, causal, scale
    "plain_lq_lt_lk": dict(b=2, hq=3, hkv=3, lq=200, lk=333),
    "causal_gqa": dict(b=2, hq=8, hkv=2, lq=333, lk=333, causal=True),
    "causal_lq_lt_lk": dict(b=1, hq=4, hkv=1, lq=130, lk=333, causal=True),
    "causal_lq_gt_lk": dict(b=1, hq=4, hkv=2, lq=333, lk=200, causal=True),
    "bool_mask": dict(b=2, hq=4, hkv=2, lq=200, lk=197, mask="bool"),
    "bool_mask_causal": dict(b=1, hq=4, hkv=4, lq=200, lk=200, mask="bool", causal=True),
    "float_mask_scale": dict(b=2, hq=2, hkv=2, lq=130, lk=200, mask="float", scale=0.3),
}


def _randn(*shape, dtype):
    return torch.randn(shape, device="cuda", dtype=torch.float32).to(dtype)


def _inputs(b, hq, hkv, lq, lk, d, dtype, mask=None, causal=False, scale=None):
    """q, k, v, mask, causality and scale of a case; a bool mask keeps key 0 of every row (eager
    gives NaN for a row without keys)."""
    q, k, v = _randn(b, hq, lq, d, dtype=dtype), _randn(b, hkv, lk, d, dtype=dtype), _randn(b, hkv, lk, d, dtype=dtype)
    m = None
    if mask == "bool":
        m = torch.rand(b, 1, lq, lk, device="cuda") > 0.3
        m[..., 0] = True
    elif mask == "float":
        m = _randn(b, hq, lq, lk, dtype=dtype)
    return q, k, v, m, causal, scale


def _run(q, k, v, mask=None, causal=False, scale=None, knobs=None):
    """attention_sm90's program for the operator's task on these inputs (`suggest`'s first
    knobs unless given), run."""
    task = tensor_task(q, k, v, mask, causal, scale)
    assert attention_sm90.applies(task)
    knobs = knobs or attention_sm90.suggest(task, torch.cuda.get_device_properties(0).multi_processor_count)[0]
    return load_template(attention_sm90, task, knobs)([q, k, v] + ([mask] if mask is not None else []))


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("d", attention_sm90.HEAD_DIMS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=lambda t: str(t)[6:])
def test_matches_sdpa(case, d, dtype):
    torch.manual_seed(0)
    q, k, v, m, causal, scale = _inputs(**CASES[case], d=d, dtype=dtype)
    check_near_eager(_run(q, k, v, m, causal, scale), q, k, v, m, causal, scale)


@pytest.mark.parametrize("knobs", attention_sm90.TEMPLATE.space(2), ids=lambda k: "-".join(map(str, k.values())))
@pytest.mark.parametrize("case,d,dtype", [("causal_gqa", 128, torch.float16), ("bool_mask", 64, torch.bfloat16),
                                          ("float_mask_scale", 96, torch.float16),
                                          ("causal_lq_gt_lk", 64, torch.float16)],
                         ids=["causal_gqa-d128", "bool_mask-d64-bf16", "float_mask-d96", "causal_lq_gt_lk-d64"])
def test_every_knob(knobs, case, d, dtype):
    torch.manual_seed(1)
    q, k, v, m, causal, scale = _inputs(**CASES[case], d=d, dtype=dtype)
    check_near_eager(_run(q, k, v, m, causal, scale, knobs), q, k, v, m, causal, scale)


@pytest.mark.parametrize("causal", [False, True])
def test_fully_masked_rows_give_zeros(causal):
    q, k, v, _, _, _ = _inputs(2, 4, 4, 200, 150, 128, torch.float16)
    mask = torch.rand(2, 4, 200, 150, device="cuda") > 0.5
    mask[:, :, 5] = False
    mask[1, 2, 130:] = False                              # the end of the second query block of one head
    out = _run(q, k, v, mask, causal)
    assert (out[:, :, 5] == 0).all() and (out[1, 2, 130:] == 0).all()
    check_near_eager(out, q, k, v, mask, causal)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=lambda t: str(t)[6:])
def test_blhd_views_read_in_place(dtype):
    task = blhd_task(2, 333, 8, 2, 128, kiln.dtypes.data_type(dtype), True)
    q, k, v = _randn(2, 333, 8, 128, dtype=dtype), _randn(2, 333, 2, 128, dtype=dtype), _randn(2, 333, 2, 128, dtype=dtype)
    for knobs in attention_sm90.TEMPLATE.space(1):
        out = load_template(attention_sm90, task, knobs)([q, k, v])
        check_near_eager(out, *(t.transpose(1, 2) for t in (q, k, v)), is_causal=True)


def test_queries_of_a_packed_projection():
    """q read from the second third of a [B, L, 3 * H * D] projection: its tensor map starts at
    an offset of H * D elements."""
    f16 = kiln.dtypes.float16
    src = TensorInput("qkv", (2, 200, 768), f16)
    k_in, v_in = (TensorInput(n, (2, 4, 200, 64), f16) for n in "kv")
    q_view = compute((2, 4, 200, 64), lambda b, h, i, e: src[b, i, 256 + h * 64 + e])
    task = Task("attention", [src, k_in, v_in],
                [attention_op.attention.definition(q_view, k_in, v_in, None, None, True)], {"is_causal": True})
    qkv, k, v = _randn(2, 200, 768, dtype=torch.float16), *(_randn(2, 4, 200, 64, dtype=torch.float16) for _ in "kv")
    out = load_template(attention_sm90, task, attention_sm90.TEMPLATE.space(0)[0])([qkv, k, v])
    check_near_eager(out, qkv[:, :, 256:512].reshape(2, 200, 4, 64).transpose(1, 2), k, v, is_causal=True)


def test_fused_epilogue_renders_into_the_hooks():
    task = bias_epilogue_task((2, 4, 200, 64))
    assert attention_sm90.applies(task)
    tq, tk, tv, tb = (_randn(*s, dtype=torch.float16) for s in ((2, 4, 200, 64),) * 3 + ((64,),))
    out = load_template(attention_sm90, task, attention_sm90.TEMPLATE.space(0)[0])([tq, tk, tv, tb])
    expected = reference(tq, tk, tv, is_causal=True) * 2 + tb.double()
    torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=2e-2)


def test_lengths_of_a_symbolic_bucket_share_one_source():
    """Causal attention over [B, L, H, D] views at a symbolic length, its output reshaped to
    [B, L, H * D]: 70, 100 and 128 queries run one source, each with its own tensor maps."""
    case = next(c for c in SYMBOLIC if c.name == "attention_prefill")
    sources = set()
    for n in (150, 200, 256):
        task = next(node.task for node in case.graph(n).nodes if attention_sm90.applies(node.task))
        knobs = attention_sm90.suggest(task, torch.cuda.get_device_properties(0).multi_processor_count)[0]
        sources.add(attention_sm90.render(task, **knobs).source)
        inputs = case.inputs(n)
        out = load_template(attention_sm90, task, knobs)(inputs)
        torch.testing.assert_close(out.float(), case.reference(*inputs)[0], atol=1e-2, rtol=1e-2)
    assert len(sources) == 1
