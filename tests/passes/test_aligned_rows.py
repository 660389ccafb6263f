"""Rows padded to 16 bytes for the GPU's GEMMs (`kiln_ops_builtin.passes.aligned_rows`): a
16-bit tensor with rows of an odd length read by two matmuls (an LM head's d(logits): along its
rows by the input's gradient, across them by the weight's) is padded once, and both matmuls
read the padded tensor, giving the values of the graph before (zeros past the row add nothing).
The pass runs on GPU graphs; here `DEVICES` lets it run on the CPU, where the values are
compared. A tensor with aligned rows, one read by a single matmul, or one that another operator
reads too, is left alone."""
import pytest
import torch

import kiln
from kiln.passes import PassContext
from kiln.passes.pipeline import optimize
from kiln_ops_builtin.passes import aligned_rows
from kiln_ops_builtin.passes.aligned_rows import AlignedRows
from tests.passes.passes_support import apply, names
from tests.support import rand

ops = kiln.ops


@pytest.fixture
def on_the_cpu(monkeypatch):
    monkeypatch.setattr(aligned_rows, "DEVICES", ("cpu",))


def _lm_head_backward(tokens, vocab, width, dtype, batch=()):
    """d(logits) W and d(logits)^T h, as an LM head's backward computes them."""
    dlogits = kiln.symbol([*batch, tokens, vocab], dtype)
    weight = kiln.symbol([vocab, width], dtype)
    hidden = kiln.symbol([*batch, tokens, width], dtype)
    d_hidden = ops.matmul(dlogits, weight)
    d_weight = ops.matmul(ops.transpose(dlogits, -1, -2), hidden)
    return kiln.trace_from([d_hidden, d_weight], [dlogits, weight, hidden])


def _values(graph, shapes, dtype, seed=0):
    torch.manual_seed(seed)
    inputs = [kiln.from_torch(rand(s, dtype)) for s in shapes]
    return [o.torch() for o in graph.run(inputs)], inputs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("tokens, vocab, width, batch", [(33, 50, 24, ()), (16, 13, 8, ()), (5, 9, 16, (2,))])
def test_a_tensor_read_along_and_across_its_rows_is_padded_once(on_the_cpu, dtype, tokens, vocab, width, batch):
    graph = _lm_head_backward(tokens, vocab, width, dtype, batch)
    out = apply(AlignedRows(), graph)
    pads = [n for n in out.nodes if n.name == "Pad"]
    wide = -(-vocab // 8) * 8
    # d(logits) once, and the weight along the contraction
    assert sorted(tuple(n.outputs[0].shape) for n in pads) == sorted([(*batch, tokens, wide), (wide, width)])
    readers = [n for n in out.nodes if any(t is graph.inputs[0] for t in n.inputs)]
    assert [n.name for n in readers] == ["Pad"], "only the pad reads the unaligned rows"
    contracting = next(n for n in out.nodes if n.name == "Matmul" and n.inputs[0] is readers[0].outputs[0])
    assert contracting.inputs[1].shape[-2] == wide
    shapes = [(*batch, tokens, vocab), (vocab, width), (*batch, tokens, width)]
    before, inputs = _values(graph, shapes, dtype)
    after = [o.torch() for o in out.run(inputs)]
    for b, a in zip(before, after):
        assert a.shape == b.shape and a.dtype == b.dtype
        # the same products summed over the same elements in float32: equal up to the order of
        # the additions a different reduction length may take
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)
    exact = [inputs[0].torch().double() @ inputs[1].torch().double(),
             inputs[0].torch().double().transpose(-1, -2) @ inputs[2].torch().double()]
    for b, a, e in zip(before, after, exact):
        assert (a.double() - e).abs().max() <= 2 * (b.double() - e).abs().max() + 1e-2


def test_the_whole_pipeline_on_the_cpu_gives_the_same_values(on_the_cpu):
    graph = _lm_head_backward(24, 37, 16, torch.bfloat16)
    with PassContext(opt_level=1):
        out = optimize(graph)
    shapes = [(24, 37), (37, 16), (24, 16)]
    before, inputs = _values(graph, shapes, torch.bfloat16, seed=1)
    after = [o.torch() for o in out.run(inputs)]
    for b, a in zip(before, after):
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("case", ["aligned", "one reader", "another reader", "read twice", "float32",
                                  "on the GPU only"])
def test_what_is_left_alone(monkeypatch, case):
    if case != "on the GPU only":
        monkeypatch.setattr(aligned_rows, "DEVICES", ("cpu",))
    dtype = torch.float32 if case == "float32" else torch.bfloat16
    vocab = 48 if case == "aligned" else 50
    dlogits, weight = kiln.symbol([16, vocab], dtype), kiln.symbol([vocab, 8], dtype)
    hidden = kiln.symbol([16, 8], dtype)
    outputs = [ops.matmul(dlogits, weight)]
    if case != "one reader":
        outputs.append(ops.matmul(ops.transpose(dlogits, -1, -2), hidden))
    if case == "another reader":
        outputs.append(ops.exp(dlogits))
    if case == "read twice":            # a Gram matrix: one matmul reads both ways
        outputs.append(ops.matmul(dlogits, ops.transpose(dlogits, -1, -2)))
    graph = kiln.trace_from(outputs, [dlogits, weight, hidden])
    assert "Pad" not in names(apply(AlignedRows(), graph))
