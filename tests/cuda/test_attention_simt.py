"""The float32 attention template (`attention_simt`) on a GPU against torch's
scaled_dot_product_attention in float64: within 1e-5 relative error (and within twice eager's
own plus a little, `attention_support.check_near_eager`), on query and key lengths that are no
multiple of the tiles, causal (fewer queries than keys and more), grouped-query heads, bool and
float masks, a scale; every knob setting of the level-2 space; fully masked rows (zeros);
[B, L, H, D] views read in place; the operator through Kiln's choice of schedule."""
import pytest
import torch

import kiln
from kiln_ops_builtin.templates import attention_simt

from tests.cuda.attention_support import (blhd_task, check_near_eager, load_template, reference, relative_error,
                                          tensor_task)

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

CASES = {  # batch, query heads, key/value heads, queries, keys; mask, causal, scale
    "plain": dict(b=2, hq=3, hkv=3, lq=77, lk=131),
    "causal_gqa": dict(b=2, hq=8, hkv=2, lq=133, lk=133, causal=True),
    "causal_lq_lt_lk": dict(b=1, hq=4, hkv=1, lq=70, lk=150, causal=True),
    "causal_lq_gt_lk": dict(b=1, hq=4, hkv=2, lq=150, lk=70, causal=True),
    "bool_mask": dict(b=2, hq=4, hkv=2, lq=65, lk=97, mask="bool"),
    "float_mask_scale": dict(b=2, hq=2, hkv=2, lq=130, lk=70, mask="float", scale=0.3),
    "decode": dict(b=3, hq=8, hkv=2, lq=1, lk=1000),
}


def _inputs(b, hq, hkv, lq, lk, d, mask=None, causal=False, scale=None):
    q, k, v = (torch.randn(b, h, n, d, device="cuda") for h, n in ((hq, lq), (hkv, lk), (hkv, lk)))
    m = None
    if mask == "bool":
        m = torch.rand(b, 1, lq, lk, device="cuda") > 0.3
        m[..., 0] = True
    elif mask == "float":
        m = torch.randn(b, hq, lq, lk, device="cuda")
    return q, k, v, m, causal, scale


def _run(q, k, v, mask=None, causal=False, scale=None, knobs=None):
    task = tensor_task(q, k, v, mask, causal, scale)
    assert attention_simt.applies(task)
    knobs = knobs or attention_simt.suggest(task, torch.cuda.get_device_properties(0).multi_processor_count)[0]
    return load_template(attention_simt, task, knobs)([q, k, v] + ([mask] if mask is not None else []))


def _check(out, q, k, v, mask, causal, scale):
    check_near_eager(out, q, k, v, mask, causal, scale)
    assert relative_error(out, reference(q, k, v, mask, scale, causal)) < 1e-5


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("d", [32, 64, 80, 128])
def test_matches_sdpa(case, d):
    torch.manual_seed(0)
    q, k, v, m, causal, scale = _inputs(**CASES[case], d=d)
    _check(_run(q, k, v, m, causal, scale), q, k, v, m, causal, scale)


@pytest.mark.parametrize("knobs", attention_simt.TEMPLATE.space(2), ids=lambda k: "-".join(map(str, k.values())))
@pytest.mark.parametrize("case", ["causal_gqa", "bool_mask", "float_mask_scale"])
def test_every_knob(knobs, case):
    torch.manual_seed(1)
    q, k, v, m, causal, scale = _inputs(**CASES[case], d=64)
    _check(_run(q, k, v, m, causal, scale, knobs), q, k, v, m, causal, scale)


@pytest.mark.parametrize("causal", [False, True])
def test_fully_masked_rows_give_zeros(causal):
    q, k, v, _, _, _ = _inputs(2, 4, 4, 100, 90, 64)
    mask = torch.rand(2, 4, 100, 90, device="cuda") > 0.5
    mask[:, :, 5] = False
    out = _run(q, k, v, mask, causal)
    assert (out[:, :, 5] == 0).all()
    _check(out, q, k, v, mask, causal, None)


def test_blhd_views_read_in_place():
    task = blhd_task(2, 133, 8, 2, 96, kiln.dtypes.float32, True)
    q, k, v = (torch.randn(2, 133, h, 96, device="cuda") for h in (8, 2, 2))
    for knobs in attention_simt.TEMPLATE.space(1):
        out = load_template(attention_simt, task, knobs)([q, k, v])
        _check(out, *(t.transpose(1, 2) for t in (q, k, v)), None, True, None)


def test_the_operator_on_the_gpu():
    torch.manual_seed(2)
    q, k, v = (torch.randn(1, 12, 128, 64, device="cuda") for _ in range(3))
    out = kiln.ops.attention(q, k, v, is_causal=True).torch()
    _check(out, q, k, v, None, True, None)
