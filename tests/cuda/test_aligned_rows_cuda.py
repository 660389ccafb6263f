"""An LM head over a vocabulary whose rows are not 16-byte multiples, trained on the GPU in
bfloat16 autocast: the backward pads d(logits) once (`kiln_ops_builtin.passes.aligned_rows`),
the input's gradient contracts over the padded rows, the weight's reads the padded tensor's
transpose in place; the gradients against float64, at most twice eager's bfloat16 error."""
import copy

import pytest
import torch

from kiln.frontend.torch.backend import KilnFunction

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("fresh_dynamo")]


class Head(torch.nn.Module):
    def __init__(self, vocab, width, tied):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.head = torch.nn.Linear(width, vocab, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.embed(ids)))


def _gradients(model, ids, dtype):
    model.zero_grad()
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype is None):
        logits = model(ids)
    torch.manual_seed(1)
    (logits.float() * torch.randn(logits.shape, device="cuda")).sum().backward()
    return [p.grad.double() for p in model.parameters()]


@pytest.mark.parametrize("vocab, tied", [(1001, True), (1001, False), (333, False)])
def test_an_unaligned_vocabulary_trains_like_eager(vocab, tied):
    torch.manual_seed(0)
    model = Head(vocab, 64, tied).cuda()
    ids = torch.randint(0, vocab, (4, 96), device="cuda")
    want = _gradients(copy.deepcopy(model).double(), ids, torch.float64)
    eager = _gradients(copy.deepcopy(model), ids, None)
    before = set(KilnFunction.live())
    got = _gradients(torch.compile(copy.deepcopy(model), backend="kiln"), ids, None)
    for g, e, w in zip(got, eager, want):
        top = w.abs().max()
        assert (g - w).abs().max() / top <= 2 * (e - w).abs().max() / top + 1e-2
    graphs = [run.graph for f in KilnFunction.live() if f not in before for run in f.graphs.values()]
    pads = [n for g in graphs for n in g.nodes
            for m in (n.attrs["fused_graph"].nodes if "fused_graph" in n.attrs else [n]) if m.name == "Pad"]
    assert pads, "the backward pads d(logits)"
