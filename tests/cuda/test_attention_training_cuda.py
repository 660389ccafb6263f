"""attention_forward and attention_backward on a CUDA GPU (the `attention_train` templates)
against float64 attention through torch autograd: each output's and gradient's largest error,
relative to the reference's largest magnitude, at most 3x eager's own (torch's
scaled_dot_product_attention in the same dtype on the GPU, forward and backward) plus a floor
of a quarter of the dtype's epsilon (where eager is exact, as at one key). float16 and
bfloat16, head dims 64 and 128 (and 32 once), causal or not, lengths that are and are not
multiples of the tiles, Lq != Lk, one and 24 batch-heads; bool masks of several broadcast
shapes; every tuning candidate once; and that the templates, not the auto-scheduler, take the
tasks."""
import math

import pytest
import torch

import kiln
from kiln.plugins.registry import registry
from kiln_ops_builtin.templates import attention_train

pytestmark = pytest.mark.cuda

DEVICE = "cuda"
LENGTHS = [(1, 1), (17, 17), (64, 64), (100, 100), (512, 512), (1000, 1000), (100, 37), (17, 300), (333, 1000)]
HEADS = [(1, 1), (2, 12)]


def _inputs(bh, lq, lk, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    b, h = bh
    q, k, v, dout = (torch.randn(b, h, n, d, generator=g).to(dtype).to(DEVICE) for n in (lq, lk, lk, lq))
    return q, k, v, dout


def _reference(q, k, v, dout, causal, dtype=torch.float64, mask=None):
    """out, lse, (dq, dk, dv) of the math form in `dtype` (float64: the reference); a bool
    `mask` keeps the keys where True."""
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    scale = 1.0 / math.sqrt(q.shape[-1])
    s = q @ k.transpose(-1, -2) * scale
    if mask is not None:
        s = s.masked_fill(mask.logical_not(), float("-inf"))
    if causal:
        i = torch.arange(q.shape[-2], device=q.device)[:, None]
        j = torch.arange(k.shape[-2], device=q.device)[None, :]
        s = s.masked_fill(j > i, float("-inf"))
    lse = torch.logsumexp(s, -1)
    out = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0) @ v     # a row with no key: zeros
    out.backward(dout.to(dtype))
    return out.detach(), lse.detach(), (q.grad, k.grad, v.grad)


def _eager(q, k, v, dout, causal, mask=None):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
    out.backward(dout)
    return out.detach(), (q.grad, k.grad, v.grad)


def _kiln(q, k, v, dout, causal, mask=None):
    out, lse = kiln.ops.attention_forward(q, k, v, None, causal, mask)
    out, lse = out.torch(), lse.torch()
    grads = kiln.ops.attention_backward(dout, q, k, v, out, lse, None, causal, mask)
    return out, lse, tuple(g.torch() for g in grads)


def _error(x, ref):
    return ((x.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item() if ref.abs().max() > 0 \
        else x.double().abs().max().item()


def _check(name, ours, eager, ref, dtype):
    assert ours.dtype == dtype and ours.shape == ref.shape, name
    assert torch.isfinite(ours).all(), name
    floor = torch.finfo(dtype).eps / 4
    mine, theirs = _error(ours, ref), _error(eager, ref)
    assert mine <= 3 * theirs + floor, f"{name}: error {mine:.3g}, eager's {theirs:.3g}"


def _compare(q, k, v, dout, causal, ours, mask=None):
    dtype = q.dtype
    out, lse, grads = ours
    ref_out, ref_lse, ref_grads = _reference(q, k, v, dout, causal, mask=mask)
    eager_out, eager_grads = _eager(q, k, v, dout, causal, mask)
    _check("out", out, eager_out, ref_out, dtype)
    assert lse.dtype == torch.float32
    assert (lse.double() - ref_lse).abs().max().item() <= 1e-3 * max(1.0, ref_lse.abs().max().item())
    for name, g, e, r in zip(("dq", "dk", "dv"), grads, eager_grads, ref_grads):
        _check(name, g, e, r, dtype)


def _tasks(q, k, v, dout, causal):
    fwd, bwd = registry().operator("attention_forward"), registry().operator("attention_backward")
    lse = torch.zeros(q.shape[:-1], device=q.device)
    return (fwd.task(fwd.bind([kiln.from_torch(t) for t in (q, k, v)] + [None, causal], {}))[0],
            bwd.task(bwd.bind([kiln.from_torch(t) for t in (dout, q, k, v, dout, lse)] + [None, causal], {}))[0])


def test_the_templates_take_the_tasks():
    from kiln.runtime.cuda import arch_number, device_info
    from kiln.schedule import schedules_for
    arch = arch_number(device_info(0)["arch"])
    for dtype in (torch.float16, torch.bfloat16):
        forward, backward = _tasks(*_inputs((2, 3), 100, 77, 64, dtype), True)
        assert schedules_for(forward, "cuda", arch)[0].name == "attention_train_forward"
        assert schedules_for(backward, "cuda", arch)[0].name == "attention_train_backward"
    forward, backward = _tasks(*_inputs((2, 3), 100, 77, 64, torch.float32), True)
    assert not schedules_for(forward, "cuda", arch) and not schedules_for(backward, "cuda", arch)


@pytest.mark.parametrize("heads", HEADS, ids=str)
@pytest.mark.parametrize("lengths", LENGTHS, ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_attention_training_matches_float64(dtype, d, causal, lengths, heads):
    q, k, v, dout = _inputs(heads, *lengths, d, dtype)
    _compare(q, k, v, dout, causal, _kiln(q, k, v, dout, causal))


@pytest.mark.parametrize("causal", [False, True])
def test_head_dim_32(causal):
    q, k, v, dout = _inputs((2, 3), 200, 150, 32, torch.bfloat16)
    _compare(q, k, v, dout, causal, _kiln(q, k, v, dout, causal))


def _mask(kind, b, h, lq, lk):
    """A bool mask keeping at least one key of every query (key 0, where the rest is random)."""
    g = torch.Generator().manual_seed(5)
    shape = {"batch": (b, 1, lq, lk), "shared": (lq, lk), "per-head": (b, h, lq, lk), "padding": (b, 1, 1, lk)}[kind]
    mask = torch.rand(shape, generator=g) > 0.4
    mask[..., 0] = True
    return mask.to(DEVICE)


@pytest.mark.parametrize("kind", ["batch", "shared", "per-head", "padding"])
@pytest.mark.parametrize("lengths", [(17, 17), (100, 100), (512, 512), (100, 37), (17, 300)], ids=str)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_masked_attention_matches_float64(dtype, d, lengths, kind):
    q, k, v, dout = _inputs((2, 12), *lengths, d, dtype)
    mask = _mask(kind, 2, 12, *lengths)
    _compare(q, k, v, dout, False, _kiln(q, k, v, dout, False, mask), mask)


def test_a_mask_with_a_causal_flag_and_rows_without_keys():
    """Both masks at once, and queries the mask leaves no key: lse -inf, output and gradients 0."""
    q, k, v, dout = _inputs((2, 3), 100, 100, 64, torch.bfloat16)
    mask = _mask("batch", 2, 3, 100, 100)
    mask[1, 0, 40:60] = False
    out, lse, (dq, dk, dv) = _kiln(q, k, v, dout, True, mask)
    ref_out, ref_lse, ref_grads = _reference(q, k, v, dout, True, mask=mask)
    assert torch.isinf(lse[1, :, 40:60]).all() and (lse[1, :, 40:60] < 0).all()
    assert (out[1, :, 40:60] == 0).all() and (dq[1, :, 40:60] == 0).all()
    kept = torch.isfinite(ref_lse)
    assert (lse[kept].double() - ref_lse[kept]).abs().max().item() <= 1e-3 * ref_lse[kept].abs().max().item()
    for name, ours, ref in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), (ref_out, *ref_grads)):
        assert _error(ours, ref) <= 2e-2, name


def _run(program, inputs, outputs):
    from kiln.runtime.backend import backend_for
    runner = backend_for(kiln.device(DEVICE)).load(program, kiln.device(DEVICE))
    runner(inputs, outputs)
    return outputs


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_every_knob_setting(causal, d):
    """Each tuning candidate of level 1 (warps, MMA tiles a warp, loop tiles), run directly."""
    dtype = torch.bfloat16
    q, k, v, dout = _inputs((1, 3), 333, 250, d, dtype, seed=1)
    forward, backward = _tasks(q, k, v, dout, causal)
    for knobs in attention_train.ForwardKnobs.settings(1):
        out, lse = _run(attention_train.render_forward(forward, **knobs), [q, k, v],
                        [torch.empty_like(q), torch.empty(q.shape[:-1], device=DEVICE)])
        _, _, ref_grads = _reference(q, k, v, dout, causal)
        for bknobs in attention_train.BackwardKnobs.settings(1):
            grads = _run(attention_train.render_backward(backward, **bknobs), [dout, q, k, v, out, lse],
                         [torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)])
            _compare(q, k, v, dout, causal, (out, lse, tuple(grads)))


def test_one_build_serves_every_length():
    """Two lengths, one source: the sizes are kernel arguments."""
    sources = set()
    for lq, lk in ((100, 100), (512, 300)):
        forward, backward = _tasks(*_inputs((2, 3), lq, lk, 64, torch.bfloat16), True)
        sources.add((attention_train.render_forward(forward).source, attention_train.render_backward(backward).source))
    assert len(sources) == 1
