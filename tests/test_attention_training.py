"""attention_forward and attention_backward (`kiln_ops_builtin.attention_training`) on the CPU
against float64 attention through torch autograd: out, lse and the three gradients, float32 and
bfloat16, causal or not, lengths 1, 7 and 65, Lq != Lk, several batch-heads. Errors are the
largest absolute error relative to the reference's largest magnitude; a Kiln result may be at
most 3x eager's own (torch's scaled_dot_product_attention and its backward in the same dtype)
plus a floor (a quarter of the dtype's epsilon, 1e-5 at least: where eager is exact, as at one
key). The tasks of 16-bit inputs at head dims 64 and 128 are those the CUDA templates
(`attention_train`) take: with KILN_NVRTC_CHECK set (`make test` sets it) the check compiles
their programs too; and a test renders both templates for several dtypes, head dims and
causality, compiles them with NVRTC for sm_80 and sm_90, and shows one source serving two
lengths."""
import math

import pytest
import torch

import kiln
from kiln.ir import Task, compute
from kiln.plugins.registry import registry
from kiln.runtime import cuda as rt
from kiln_ops_builtin.templates import attention_train

needs_nvrtc = pytest.mark.skipif(not rt.nvrtc_available(), reason="cuda-bindings / nvidia-cuda-nvrtc "
                                 "not installed: pip install 'kiln-core[cuda]'")


def _inputs(lead, lq, lk, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(*lead, n, d, generator=g).to(dtype) for n in (lq, lk, lk, lq))


def _reference(q, k, v, dout, scale, causal):
    """out, lse, (dq, dk, dv) of the math form in float64."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    s = q @ k.transpose(-1, -2) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    out = torch.softmax(s, -1) @ v
    out.backward(dout.double())
    return out.detach(), torch.logsumexp(s, -1).detach(), (q.grad, k.grad, v.grad)


def _eager(q, k, v, dout, scale, causal):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    out.backward(dout)
    return out.detach(), (q.grad, k.grad, v.grad)


def _error(x, ref):
    top = ref.abs().max()
    return ((x.double() - ref).abs().max() / top).item() if top > 0 else x.double().abs().max().item()


def _check(name, ours, eager, ref, dtype):
    assert ours.dtype == dtype and ours.shape == ref.shape, name
    floor = max(torch.finfo(dtype).eps / 4, 1e-5)
    mine, theirs = _error(ours, ref), _error(eager, ref)
    assert mine <= 3 * theirs + floor, f"{name}: error {mine:.3g}, eager's {theirs:.3g}"


def _compare(lead, lq, lk, d, dtype, causal, scale=None):
    q, k, v, dout = _inputs(lead, lq, lk, d, dtype)
    out, lse = kiln.ops.attention_forward(q, k, v, scale, causal)
    out, lse = out.torch(), lse.torch()
    grads = [g.torch() for g in kiln.ops.attention_backward(dout, q, k, v, out, lse, scale, causal)]
    used = 1 / math.sqrt(d) if scale is None else scale
    ref_out, ref_lse, ref_grads = _reference(q, k, v, dout, used, causal)
    eager_out, eager_grads = _eager(q, k, v, dout, used, causal)
    _check("out", out, eager_out, ref_out, dtype)
    assert lse.dtype == torch.float32 and lse.shape == ref_lse.shape
    assert (lse.double() - ref_lse).abs().max().item() <= 1e-4 * max(1.0, ref_lse.abs().max().item())
    for name, g, e, r in zip(("dq", "dk", "dv"), grads, eager_grads, ref_grads):
        _check(name, g, e, r, dtype)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("lead,lq,lk", [((1,), 1, 1), ((2, 3), 7, 7), ((1, 2), 65, 65), ((3,), 7, 65), ((2,), 65, 7)],
                         ids=str)
def test_attention_training_matches_float64(lead, lq, lk, dtype, causal):
    _compare(lead, lq, lk, 16, dtype, causal)


def test_a_given_scale():
    _compare((2,), 9, 12, 16, torch.float32, True, scale=0.37)


@pytest.mark.parametrize("dtype,d,causal", [(torch.bfloat16, 64, True), (torch.float16, 64, False),
                                            (torch.bfloat16, 128, False), (torch.float16, 128, True)], ids=str)
def test_head_dims_of_the_cuda_templates(dtype, d, causal):
    """Tasks the CUDA templates take (their programs NVRTC-checked under KILN_NVRTC_CHECK)."""
    _compare((1, 2), 5, 3, d, dtype, causal)


def _task(op, *args):
    definition = registry().operator(op)
    return definition.task(definition.bind(args, {}))[0]


def _tasks(lead, lq, lk, d, dtype, causal, dv=None):
    q, k, v, dout = _inputs(lead, lq, lk, d, dtype)
    if dv is not None:
        v, dout = torch.zeros(*lead, lk, dv, dtype=dtype), torch.zeros(*lead, lq, dv, dtype=dtype)
    lse = torch.zeros(q.shape[:-1])
    return (_task("attention_forward", q, k, v, None, causal),
            _task("attention_backward", dout, q, k, v, dout, lse, None, causal))


def test_which_tasks_the_templates_take():
    from kiln.schedule import schedules_for
    for task in _tasks((2, 3), 100, 77, 64, torch.bfloat16, True) + _tasks((4,), 9, 9, 128, torch.float16, False):
        assert attention_train.applies(task)
        # what the NVRTC check (and a GPU build) renders first for the task
        assert schedules_for(task, "cuda")[0].name == {"attention_forward": "attention_train_forward",
                                                       "attention_backward": "attention_train_backward"}[task.name]
    for task in (*_tasks((2,), 9, 9, 64, torch.float32, False),     # float32: the auto-scheduler
                 *_tasks((2,), 9, 9, 48, torch.bfloat16, False),    # head dim
                 *_tasks((2,), 9, 9, 64, torch.bfloat16, False, dv=32)):   # Dv != D
        assert not attention_train.applies(task)
    forward = _tasks((2,), 9, 9, 64, torch.bfloat16, False)[0]
    fused = Task(forward.name, forward.inputs, [compute(forward.outputs[0].shape, lambda *i: forward.outputs[0][i] * 2),
                                                forward.outputs[1]], forward.attrs)
    assert not attention_train.applies(fused)                           # an epilogue fused in
    q, k, v, dout = _inputs((2,), 9, 9, 64, torch.bfloat16)
    assert not attention_train.applies(_task("attention_backward", dout, q, k, v, dout,
                                             torch.zeros(2, 9, dtype=torch.bfloat16), None, False))  # lse not float32
    mask = torch.rand(2, 9, 9) > 0.5
    assert attention_train.applies(_task("attention_forward", q, k, v, None, False, mask))
    assert attention_train.applies(_task("attention_backward", dout, q, k, v, dout, torch.zeros(2, 9), None,
                                         False, mask))
    q4, k4, v4, _ = _inputs((2, 1, 3), 9, 9, 64, torch.bfloat16)      # three leading dims and a mask
    assert not attention_train.applies(_task("attention_forward", q4, k4, v4, None, False,
                                             torch.rand(2, 1, 3, 9, 9) > 0.5))


@pytest.mark.parametrize("mask_shape, sizes", [
    ((9, 9), (3, 0, 0, 9, 1)),                  # every batch-head: strides 0
    ((2, 1, 9, 9), (3, 81, 0, 9, 1)),           # transformers' [batch, 1, Lq, Lk]
    ((2, 3, 1, 9), (3, 27, 9, 0, 1)),           # a padding mask: one row for every query
])
def test_how_the_kernels_read_a_mask(mask_shape, sizes):
    q, k, v, dout = _inputs((2, 3), 9, 9, 64, torch.bfloat16)
    mask = torch.rand(mask_shape) > 0.5
    forward = _task("attention_forward", q, k, v, None, True, mask)
    backward = _task("attention_backward", dout, q, k, v, dout, torch.zeros(2, 3, 9), None, True, mask)
    assert attention_train.render_forward(forward).sizes == (9, 9, 6, *sizes)
    assert attention_train.render_backward(backward).sizes == (9, 9, 6, *sizes)


def test_one_source_serves_every_length():
    """Sizes are kernel arguments: two lengths (and batch-heads) render one source each way."""
    programs = [[attention_train.render_forward(f), attention_train.render_backward(b)]
                for f, b in (_tasks((2, 3), 100, 100, 64, torch.bfloat16, True),
                             _tasks((5,), 512, 300, 64, torch.bfloat16, True))]
    for first, second in zip(*programs):
        assert first.source == second.source
        assert first.sizes != second.sizes
        assert [launch.grid for launch in first.launches] != [launch.grid for launch in second.launches]
    assert programs[1][0].sizes == (512, 300, 5)
    assert [launch.kernel for launch in programs[0][1].launches] == [
        "kiln_attention_train_delta", "kiln_attention_train_backward"]


@needs_nvrtc
def test_the_templates_compile():
    """Both templates for several dtypes, head dims and causality, for sm_80 and sm_90."""
    jobs = []
    for dtype, d, causal in [(torch.float16, 64, False), (torch.bfloat16, 64, True), (torch.bfloat16, 128, False),
                             (torch.float16, 128, True), (torch.bfloat16, 32, True)]:
        forward, backward = _tasks((2, 3), 17, 33, d, dtype, causal)
        for program in (attention_train.render_forward(forward), attention_train.render_backward(backward)):
            jobs += [(rt.launch_source(program, arch), f"attention_train{len(jobs)}", arch) for arch in ("sm_80", "sm_90")]
    q, k, v, dout = _inputs((2, 3), 17, 33, 64, torch.bfloat16)
    mask = torch.rand(2, 1, 17, 33) > 0.5
    for program in (attention_train.render_forward(_task("attention_forward", q, k, v, None, False, mask)),
                    attention_train.render_backward(_task("attention_backward", dout, q, k, v, dout,
                                                          torch.zeros(2, 3, 17), None, False, mask))):
        jobs += [(rt.launch_source(program, arch), f"attention_train{len(jobs)}", arch) for arch in ("sm_80", "sm_90")]
    rt.compile_many(jobs)
