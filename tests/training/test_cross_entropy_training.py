"""Cross-entropy in training graphs: forward and gradients against eager (odd vocabulary sizes,
ignored rows, class weights, label smoothing, every reduction, non-contiguous logits, spatial
targets), under bfloat16 autocast against a float64 reference next to eager's error, and the
backward of log-softmax + NLL as one row kernel that holds no tensor of the logits' size."""
import math

import pytest
import torch
import torch.nn.functional as F

from kiln.frontend.torch import KilnFunction, mapping_registry
from training_support import check

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

aten = torch.ops.aten


def targets(rows: int, classes: int, ignored=(1, 4)):
    """Random class indices, with ignore_index (-100) at the positions `ignored`."""
    t = torch.randint(0, classes, (rows,))
    t[list(ignored)] = -100
    return t


@pytest.mark.parametrize("reduction, smoothing, weighted", [
    ("mean", 0.0, False), ("sum", 0.0, True), ("none", 0.0, False), ("mean", 0.1, True),
    ("none", 0.2, False),
])
def test_lm_head_cross_entropy(reduction, smoothing, weighted):
    torch.manual_seed(0)
    vocab = 97
    h, w, b, t = torch.randn(7, 12), torch.randn(vocab, 12) / 4, torch.randn(vocab), targets(7, vocab)
    weight = torch.rand(vocab) + 0.5 if weighted else None
    check(lambda h, w, b: F.cross_entropy(F.linear(h, w, b), t, weight, reduction=reduction,
                                          label_smoothing=smoothing), h, w, b)


def test_non_contiguous_logits_and_other_shapes():
    torch.manual_seed(0)
    # logits transposed in memory, an odd vocabulary
    labels = targets(9, 101)
    check(lambda x: F.cross_entropy(x, labels), torch.randn(101, 9).t())
    # spatial targets (nll_loss2d), ignored pixels
    pixels = torch.randint(0, 5, (2, 3, 4))
    pixels[0, 1, 2] = pixels[1, 0, 0] = -100
    weight = torch.rand(5)
    check(lambda x: F.cross_entropy(x, pixels, reduction="none"), torch.randn(2, 5, 3, 4))
    check(lambda x: F.cross_entropy(x, pixels, weight), torch.randn(2, 5, 3, 4))
    # one sample without a batch dim
    check(lambda x: F.cross_entropy(x, torch.tensor(3)), torch.randn(11))


def test_bfloat16_autocast_is_no_further_from_float64_than_eager():
    torch.manual_seed(0)
    vocab = 203
    h, w, t = torch.randn(8, 32), torch.randn(vocab, 32) / 6, targets(8, vocab)

    def loss_and_grads(fn, dtype=None):
        leaves = [x.to(dtype or x.dtype, copy=True).requires_grad_(True) for x in (h, w)]
        with torch.autocast("cpu", torch.bfloat16, enabled=dtype is None):
            loss = fn(*leaves, t)
        loss.backward()
        return [loss.double()] + [x.grad.double() for x in leaves]

    def lm_head(h, w, t):
        return F.cross_entropy(h @ w.t(), t)

    exact = loss_and_grads(lm_head, torch.float64)
    eager = loss_and_grads(lm_head)
    kiln = loss_and_grads(torch.compile(lm_head, backend="kiln"))
    for name, e, want, got in zip(("loss", "grad h", "grad w"), exact, eager, kiln):
        eager_error, kiln_error = (want - e).abs().max().item(), (got - e).abs().max().item()
        assert kiln_error <= 1.5 * eager_error + 1e-6, f"{name}: Kiln {kiln_error} vs eager {eager_error}"


def backward_graph(fn, x, t):
    """The optimized FlowGraph Kiln runs for the backward of fn(x, t)."""
    leaf = x.detach().requires_grad_(True)
    loss = torch.compile(fn, backend="kiln")(leaf, t)
    before = set(KilnFunction.live())
    loss.backward()
    (new,) = [f for f in KilnFunction.live() if f not in before]
    (run,) = new.graphs.values()
    torch.testing.assert_close(leaf.grad, torch.func.grad(fn)(x, t), rtol=1e-5, atol=1e-7)
    return run.graph


def test_backward_is_one_row_kernel_without_a_tensor_of_the_logits_size():
    """Before: torch's decomposition of nll_loss_backward scatters -1 into zeros of the logits'
    size (here small enough to be a constant of Kiln's graph) in a kernel of its own, before the
    log-softmax backward's row kernel. After (Kiln's decomposition, a one-hot of the targets):
    one row kernel computes scale * (softmax - onehot(target)) from what the forward saved and
    the targets."""
    torch.manual_seed(0)
    rows, vocab = 6, 1001
    x, t = torch.randn(rows, vocab), targets(rows, vocab)

    def loss(x, t):
        return F.cross_entropy(x, t)

    def logits_sized(graph):
        return [c for n in graph.nodes for c in n.inputs
                if not c.is_symbolic and math.prod(c.shape) >= rows * vocab]

    removed = mapping_registry().remove(aten.nll_loss_backward.default)
    try:
        before = backward_graph(loss, x, t)
    finally:
        for rule in removed:
            mapping_registry().add(rule)
    torch._dynamo.reset()
    after = backward_graph(loss, x, t)
    assert (len(before.nodes), len(logits_sized(before))) == (2, 1)
    assert (len(after.nodes), len(logits_sized(after))) == (1, 0)
