"""The attention operator and scaled_dot_product_attention's mapping against PyTorch."""
import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.graph import OperatorError
from kiln_mappings_builtin.nn import _attention_supported
from tests.cuda.attention_support import masks, reference
from tests.frontend.frontend_support import Capture
from tests.support import rand

f16, bf16, f32, f64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
TOL = {f32: dict(atol=2e-5, rtol=1e-4), f16: dict(atol=2e-3, rtol=2e-3), bf16: dict(atol=1.6e-2, rtol=1.6e-2)}


def _qkv(b, hq, hkv, lq, lk, d, dv, dtype):
    return (rand((b, hq, lq, d), dtype), rand((b, hkv, lk, d), dtype), rand((b, hkv, lk, dv), dtype))


def _check(out, q, k, v, **kw):
    assert out.dtype == q.dtype and out.shape == q.shape[:-1] + v.shape[-1:]
    torch.testing.assert_close(out.double(), reference(q, k, v, **kw), **TOL[q.dtype])


@pytest.mark.parametrize("kind,dtype", [(kind, f32) for kind in ("bool", "float", "padding", "additive_padding")]
                         + [("bool", f16), ("float", f16), ("padding", bf16), ("additive_padding", bf16)])
def test_masks(kind, dtype):
    q, k, v = _qkv(2, 3, 3, 5, 7, 16, 16, dtype)
    mask = masks(5, 7, dtype)[kind]
    _check(kiln.ops.attention(q, k, v, mask=mask).torch(), q, k, v, mask=mask)


@pytest.mark.parametrize("lq,lk,dtype", [(6, 6, f32), (3, 9, f32), (9, 4, f32), (3, 9, bf16)])
def test_causal_with_any_lengths(lq, lk, dtype):
    q, k, v = _qkv(1, 2, 2, lq, lk, 8, 5, dtype)
    _check(kiln.ops.attention(q, k, v, is_causal=True).torch(), q, k, v, is_causal=True)


@pytest.mark.parametrize("hq,hkv", [(8, 2), (6, 1), (4, 4)])
def test_grouped_and_multi_query(hq, hkv):
    q, k, v = _qkv(2, hq, hkv, 5, 9, 16, 12, f32)
    _check(kiln.ops.attention(q, k, v, is_causal=True, scale=0.3).torch(), q, k, v, is_causal=True, scale=0.3)


@pytest.mark.parametrize("d,dtype", [(64, f16), (80, f32), (96, bf16), (128, f16), (128, f32), (3, f32), (17, bf16)])
def test_head_dims(d, dtype):
    q, k, v = _qkv(1, 2, 1, 4, 11, d, d, dtype)
    _check(kiln.ops.attention(q, k, v).torch(), q, k, v)


def test_fully_masked_rows_give_zeros_as_torch():
    q, k, v = _qkv(1, 2, 2, 4, 5, 8, 8, f32)
    keep = torch.rand(4, 5) > 0.5
    keep[:, 0], keep[2] = True, False
    additive = torch.where(keep, 0.0, float("-inf"))
    for mask in (keep, additive):
        out = kiln.ops.attention(q, k, v, mask=mask).torch()
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        assert (out[:, :, 2] == 0).all() and (expected[:, :, 2] == 0).all()
        torch.testing.assert_close(out, expected, **TOL[f32])


def test_non_contiguous_and_3d_inputs():
    q = rand((5, 3, 8)).transpose(0, 1)      # [3 heads, 5, 8], not contiguous
    k, v = rand((3, 7, 8)), rand((8, 7, 3)).transpose(0, 2)
    assert not q.is_contiguous() and not v.is_contiguous()
    _check(kiln.ops.attention(q, k, v, scale=0.7).torch(), q, k, v, scale=0.7)


@pytest.mark.parametrize("args,message", [
    (((2, 3, 4, 8), (2, 2, 5, 8), (2, 2, 5, 8)), "not a multiple"),
    (((2, 4, 4, 8), (2, 2, 5, 6), (2, 2, 5, 8)), "do not fit"),
    (((4, 4, 8), (2, 2, 5, 8), (2, 2, 5, 8)), "one rank"),
])
def test_unsupported_shapes_are_named(args, message):
    with pytest.raises(OperatorError, match=message):
        kiln.ops.attention(*(rand(s) for s in args))


def test_mask_that_widens_the_scores_is_refused():
    q, k, v = _qkv(1, 2, 2, 3, 4, 8, 8, f32)
    with pytest.raises(OperatorError, match="does not broadcast"):
        kiln.ops.attention(q, k, v, mask=rand((3, 2, 3, 4)))


def operator_names(capture) -> list[str]:
    """The operators of every graph Kiln compiled in `capture`."""
    return [n.name for c in capture.compiled for g in c.graphs.values() for n in g.graph.nodes]


def _errors(q, k, v, out, **kw):
    """Mean and maximum absolute error of `out` against the float64 reference."""
    err = (out.double() - reference(q, k, v, **kw)).abs()
    return err.mean().item(), err.max().item()


@pytest.mark.parametrize("dtype", [f16, bf16])
@pytest.mark.parametrize("options", [{}, {"scale": 0.125}, {"mask": "float", "scale": 0.3},
                                     {"mask": "bool"}, {"is_causal": True}])
def test_sdpa_16_bit_error_at_most_twice_eager(dtype, options):
    """Issue 14: Kiln's and eager's errors against float64; Kiln's at most 2x eager's."""
    torch.manual_seed(0)
    q, k, v = _qkv(2, 2, 2, 64, 96, 128, 128, dtype)
    kw = dict(options)
    if "mask" in kw:
        kw["attn_mask"] = masks(64, 96, dtype)[kw.pop("mask")][..., :64, :]
    torch._dynamo.reset()
    compiled = torch.compile(F.scaled_dot_product_attention, backend="kiln", fullgraph=True)
    eager, kiln_out = F.scaled_dot_product_attention(q, k, v, **kw), compiled(q, k, v, **kw)
    ref_kw = {("mask" if n == "attn_mask" else n): a for n, a in kw.items()}
    eager_mean, eager_max = _errors(q, k, v, eager, **ref_kw)
    kiln_mean, kiln_max = _errors(q, k, v, kiln_out, **ref_kw)
    assert kiln_out.dtype == dtype
    assert kiln_mean <= 2 * eager_mean and kiln_max <= 2 * eager_max, (kiln_mean, eager_mean, kiln_max, eager_max)


def test_sdpa_maps_to_one_attention_operator_and_declines_what_it_cannot_do():
    q, k, v = _qkv(2, 4, 2, 5, 6, 8, 8, f32)
    capture = Capture()
    torch._dynamo.reset()
    fn = torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
                       backend=capture, fullgraph=True)
    torch.testing.assert_close(fn(q, k, v), reference(q, k, v, is_causal=True).float(), **TOL[f32])
    assert operator_names(capture) == ["Attention"]
    assert _attention_supported(q, k, v, dropout_p=0.0, is_causal=True, enable_gqa=True)
    assert not _attention_supported(q, k, v, dropout_p=0.1)
    assert not _attention_supported(q, k, v, enable_gqa=False)
    assert not _attention_supported(q, k[:, :1], v[:, :1], attn_mask=torch.ones(5, 6, dtype=torch.bool),
                                    is_causal=True)


def test_sdpa_with_queries_of_lower_rank_broadcasts_as_torch():
    """OpInfo's sample: q [4, 3, 8] against k, v [4, 4, 6, 8] (q's leading dim is the heads)."""
    q, k, v = rand((4, 3, 8)), rand((4, 4, 6, 8)), rand((4, 4, 6, 8))
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                             backend="kiln", fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v), F.scaled_dot_product_attention(q, k, v, is_causal=True),
                               **TOL[f32])


def test_sdpa_declines_what_the_operator_cannot_compute():
    q, k, v = _qkv(2, 4, 4, 5, 6, 8, 8, f32)
    assert not _attention_supported(q[:1, :1], k, v)                          # one query head, four kv heads
    assert not _attention_supported(q, k, v[:1])                              # k and v batches differ
    assert not _attention_supported(q[:1], k[:1], v[:1], attn_mask=rand((2, 1, 5, 6)))  # mask widens
    assert _attention_supported(q, k, v, attn_mask=rand((2, 1, 1, 6)))
