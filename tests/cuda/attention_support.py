"""What the attention tests share: PyTorch's reference in float64 and a check against eager's own
error, masks of every kind, an attention task from shapes or from tensors, and a template's
program for a task loaded on the GPU."""
import torch
import torch.nn.functional as F

import kiln
from kiln import dtypes
from kiln.ir import Task, TensorInput, cast, compute
from kiln.passes.fused import fold_anchor
from kiln_ops_builtin import attention as attention_op
from tests.support import rand


def _merged(q, k, mask, is_causal):
    """(mask, is_causal) as sdpa takes them: a causal edge with a mask made part of the mask."""
    if is_causal and mask is not None:
        lower = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        return (mask & lower if mask.dtype == torch.bool else mask.masked_fill(~lower, float("-inf"))), False
    return mask, is_causal


def _zero_dead_rows(out, mask, keys):
    """`out` with zeros in the rows whose keys a bool `mask` masks all, as the attention
    operator defines them (sdpa gives NaN)."""
    if mask is None or mask.dtype != torch.bool:
        return out
    dead = ~mask.expand(*out.shape[:-1], keys).any(-1, keepdim=True)
    return torch.where(dead, torch.zeros_like(out), out)


def reference(q, k, v, mask=None, scale=None, is_causal=False):
    """Eager PyTorch in float64: key/value heads repeated for grouped-query attention, a causal
    edge with a mask made part of the mask (sdpa takes one or the other), rows whose keys are
    all masked zeros."""
    if q.ndim >= 3:
        k, v = (t.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3) for t in (k, v))
    mask, causal = _merged(q, k, mask, is_causal)
    wide = mask.double() if mask is not None and mask.is_floating_point() else mask
    out = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=wide, scale=scale,
                                         is_causal=causal)
    return _zero_dead_rows(out, mask, k.shape[-2])


def relative_error(got, want) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


def check_near_eager(out, q, k, v, mask=None, is_causal=False, scale=None):
    """`out` (no NaN, q's dtype) within twice the relative error of eager 16-bit sdpa on the
    same inputs, plus 1e-3, both against the float64 `reference`."""
    want = reference(q, k, v, mask, scale, is_causal)
    assert out.dtype == q.dtype and out.shape == want.shape and not out.isnan().any()
    m, causal = _merged(q, k, mask, is_causal)
    eager = F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=causal, scale=scale,
                                           enable_gqa=q.shape[-3] != k.shape[-3])
    bound = 2 * relative_error(_zero_dead_rows(eager, m, k.shape[-2]), want) + 1e-3
    assert relative_error(out, want) <= bound, (relative_error(out, want), bound)


def masks(lq, lk, dtype):
    """Masks of the scores [2, heads, lq, lk] by kind: bool [lq, lk] (every row keeps key 0), a
    float [2, 1, lq, lk], key padding as a bool [2, 1, 1, lk] and as an additive float."""
    keep = torch.rand(lq, lk) > 0.4
    keep[:, 0] = True
    padding = torch.ones(2, 1, 1, lk, dtype=torch.bool)
    padding[1, :, :, lk - 2:] = False
    return {"bool": keep, "float": rand((2, 1, lq, lk), dtype), "padding": padding,
            "additive_padding": torch.where(padding, 0.0, torch.finfo(dtype).min).to(dtype)}


def attention_task(q, k, v=None, dtype=dtypes.float16, mask=None, causal=False, scale=None) -> Task:
    """The attention task on inputs of shapes q, k and v (v: k's by default) and dtype; `mask` is
    (shape, dtype) or None."""
    ins = [TensorInput("q", q, dtype), TensorInput("k", k, dtype), TensorInput("v", v or k, dtype)]
    if mask is not None:
        ins.append(TensorInput("mask", mask[0], mask[1]))
    out = attention_op.attention.definition(*ins[:3], ins[3] if mask else None, scale, causal)
    return Task("attention", ins, [out], {"scale": scale, "is_causal": causal})


def blhd_task(b, l, hq, hkv, d, dtype, causal):
    """An attention task reading q, k, v from [B, L, H, D] inputs through permuting computes
    (as a transposed projection's view fuses in)."""
    ins = [TensorInput(n, (b, l, h, d), dtype) for n, h in (("q", hq), ("k", hkv), ("v", hkv))]
    views = [compute((b, h, l, d), lambda i, j, s, e, t=t: t[i, s, j, e]) for t, h in zip(ins, (hq, hkv, hkv))]
    out = attention_op.attention.definition(*views, None, None, causal)
    return Task("attention", ins, [out], {"mask": None, "scale": None, "is_causal": causal})


def bias_epilogue_task(shape) -> Task:
    """Causal attention on float16 q, k, v of `shape` with a fused epilogue folded in:
    (attention * 2 + bias[column]) in float32, cast back to float16."""
    f16 = dtypes.float16
    q, k, v = (TensorInput(n, shape, f16) for n in "qkv")
    bias = TensorInput("bias", (shape[-1],), f16)
    att = attention_op.attention.definition(q, k, v, None, None, True)
    epilogue = compute(att.shape, lambda *i: cast(cast(att[i], "float32") * 2.0 + cast(bias[i[-1]], "float32"), f16))
    return Task("attention", [q, k, v, bias], [fold_anchor(epilogue, att)], {"is_causal": True})


def load_template(template, task, knobs):
    """`template`'s program for `task` with `knobs`, loaded on the GPU: a function of the input
    tensors returning a new output (filled with NaN before the run, so unwritten elements show)."""
    from kiln.runtime.backend import backend_for
    runner = backend_for(kiln.device("cuda")).load(template.render(task, **knobs), kiln.device("cuda"))

    def run(inputs):
        out = torch.full(task.outputs[0].shape, float("nan"), dtype=task.outputs[0].dtype.torch_dtype, device="cuda")
        runner(inputs, [out])
        return out
    return run


def tensor_task(q, k, v, mask=None, is_causal=False, scale=None) -> Task:
    """The attention operator's task on torch tensors q, k, v (and mask)."""
    from kiln.plugins.registry import registry
    definition = registry().operator("attention")
    args = definition.bind([kiln.from_torch(t) for t in (q, k, v)],
                           {"mask": None if mask is None else kiln.from_torch(mask), "is_causal": is_causal,
                            "scale": scale})
    return definition.task(args)[0]
