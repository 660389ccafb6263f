"""What the attention template tests share: an attention task from shapes, and a template's
program for a task loaded on the GPU."""
import torch

import kiln
from kiln import dtypes
from kiln.ir import Task, TensorInput
from kiln_ops_builtin import attention as attention_op


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
