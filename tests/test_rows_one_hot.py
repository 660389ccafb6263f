"""One-hot sums in row tasks (`kiln.schedule.rows.row_form`): the sum over a row of
select((e == k) and r, a, b), k, r, a, b the same along the row (the backward of nll_loss:
where(arange == target, -g / n, 0), summed by log-softmax's backward), in closed form, so
that the row kernel does not loop over the row for it. Values against eager on the CPU, whose
row kernels take the same row form; the CUDA source without a GPU."""
import pytest
import torch

import kiln
from kiln.ir.expr import Reduce, walk
from kiln.ir.inline import inline_task
from kiln.schedule.choose import auto_program
from kiln.graph.operator import tracing
from kiln.schedule.rows import row_form, row_task

pytestmark = pytest.mark.usefixtures("fresh_dynamo")
ops = kiln.ops
VOCAB = 9001        # an int64 arange of the vocabulary is more than a graph holds as a constant


def _log_softmax_backward_of_nll(x, target, g, other):
    """d(x) of nll_loss(log_softmax(x)) as AOTAutograd's decomposition writes it, the
    one-hot gradient `g` at the target (none at -100) and `other` elsewhere."""
    hot = (torch.arange(x.shape[-1]) == target[:, None]) & (target[:, None] != -100)
    grad = torch.where(hot, g[:, None], other)
    return grad - torch.exp(x) * grad.sum(-1, keepdim=True)


@pytest.mark.parametrize("other", (0.0, 0.375))
def test_one_hot_sums_match_eager(other):
    torch.manual_seed(0)
    x = torch.log_softmax(torch.randn(64, VOCAB), -1)
    target = torch.randint(0, VOCAB, (64,))
    target[:4] = torch.tensor([-100, 0, VOCAB - 1, VOCAB + 3])      # ignored, both ends, outside the row
    g = torch.randn(64)
    other = torch.tensor(other)
    got = torch.compile(_log_softmax_backward_of_nll, backend="kiln")(x, target, g, other)
    torch.testing.assert_close(got, _log_softmax_backward_of_nll(x, target, g, other), rtol=1e-5, atol=1e-5)


def _task():
    with tracing():
        return _traced_task()


def _traced_task():
    """GPT-2's: logits [8, 512, 50257], labels shifted from a padded [8, 513]."""
    x = kiln.symbol((8, 512, 50257), torch.bfloat16, "cpu")
    labels = kiln.symbol((8, 513), torch.int64, "cpu")
    g, zero = kiln.symbol((), torch.float32, "cpu"), kiln.symbol((), torch.float32, "cpu")
    target = ops.unsqueeze(ops.slice(labels, 1, 1, None), 2)
    hot = ops.logical_and(ops.eq(ops.arange(50257, dtype=torch.int64, device="cpu"), target),
                          ops.ne(target, -100))
    grad = ops.where(hot, g, zero)
    xf = ops.cast(x, torch.float32)
    out = ops.cast(ops.sub(grad, ops.mul(ops.exp(xf), ops.sum(grad, [2], True))), torch.bfloat16)
    (node,) = kiln.graph.optimize(kiln.trace_from(out, [x, labels, g, zero])).nodes
    return node.task


def test_the_row_kernel_of_a_one_hot_sum_does_not_reduce():
    """GPT-2's log-softmax + NLL backward over bf16 logits: one pass, writing."""
    task = _task()
    lowered = inline_task(task)
    form = row_form(lowered, *row_task(lowered))
    assert not any(isinstance(y, Reduce) for value in form.stats for y in walk(value))
    src = auto_program(task, "cuda").source
    assert "__syncthreads" not in src and src.count("const kiln_pack<uint16_t, 8> ") == 1
