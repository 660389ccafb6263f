"""What the attention tests share: PyTorch's reference in float64, masks of every kind, an
attention task from shapes, and a template's program for a task loaded on the GPU."""
import torch
import torch.nn.functional as F

import kiln
from kiln import dtypes
from kiln.ir import Task, TensorInput
from kiln_ops_builtin import attention as attention_op
from tests.support import rand


def reference(q, k, v, mask=None, scale=None, is_causal=False):
    """Eager PyTorch in float64: key/value heads repeated for grouped-query attention, a causal
    edge with a mask made part of the mask (sdpa takes one or the other)."""
    if q.ndim >= 3:
        k, v = (t.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3) for t in (k, v))
    mask = mask.double() if mask is not None and mask.is_floating_point() else mask
    if is_causal and mask is not None:
        lower = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
        mask, is_causal = mask & lower if mask.dtype == torch.bool else mask.masked_fill(~lower, float("-inf")), False
    return F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask, scale=scale,
                                          is_causal=is_causal)


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
