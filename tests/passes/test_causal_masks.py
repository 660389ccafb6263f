"""Inference attention under a mask built in the graph from positions alone
(kiln_ops_builtin.passes.causal_masks), on the CPU: a mask equal to the causal pattern becomes
the `is_causal` flag and one keeping every key goes, while any other stays; at symbolic sizes
the decision is a check, computed again where the plan is reused: later lengths reuse it where
the mask is causal there too, and trace anew where it is not. Outputs match eager's always."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kiln.frontend.torch.backend import KilnFunction
from tests.passes.test_layout import members

pytestmark = pytest.mark.usefixtures("fresh_dynamo", "no_nvrtc_check")


class PositionMasked(nn.Module):
    """Attention of 2 heads over x [B, n, 32] under the mask keeping key j for query i where
    j <= i + shift (transformers' causal comparison, shifted), and every key for the queries
    from `open_from` on."""

    def __init__(self, shift=0, open_from=None):
        super().__init__()
        self.shift, self.open_from = shift, open_from
        self.qkv = nn.Linear(32, 96)

    def forward(self, x):
        b, n, _ = x.shape
        pos = torch.arange(n, device=x.device)
        keep = pos[None, :] <= pos[:, None] + self.shift
        if self.open_from is not None:
            keep = keep | (pos[:, None] >= self.open_from)
        q, k, v = (t.view(b, n, 2, 16).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep).transpose(1, 2).reshape(b, n, 32)


def _attention_nodes(model, lengths, dynamic):
    """The attention nodes of the graphs Kiln traced for `model` called at each of `lengths`,
    after asserting its outputs match eager's."""
    torch.manual_seed(0)
    before = set(KilnFunction.live())
    compiled = torch.compile(model, backend="kiln", dynamic=dynamic, options={"graph_cache": False})
    with torch.no_grad():
        for n in lengths:
            x = torch.randn(2, n, 32)
            torch.testing.assert_close(compiled(x), model(x), atol=1e-5, rtol=1e-5)
    graphs = [run.graph for f in KilnFunction.live() if f not in before for run in f.graphs.values()
              if run.graph is not None]
    return [n for g in graphs for n in members(g) if n.definition.name == "attention"]


@pytest.mark.parametrize("shift, causal", [(0, True), (1000, False), (1, None)])
def test_a_positional_mask_at_fixed_sizes_becomes_the_causal_flag(shift, causal):
    (node,) = _attention_nodes(PositionMasked(shift).eval(), [7], dynamic=False)
    masks = [t for t in node.inputs if t.dtype.is_bool]
    assert node.attrs["is_causal"] is bool(causal) and len(masks) == (causal is None)


def test_a_causal_mask_at_symbolic_sizes_becomes_the_flag_and_the_plan_serves_other_lengths(traced):
    (node,) = _attention_nodes(PositionMasked(0).eval(), [7, 9, 12], dynamic=True)
    assert len(traced) == 1      # 9 and 12 bind the plan traced at 7
    assert node.attrs["is_causal"] and not any(t.dtype.is_bool for t in node.inputs)


def test_a_mask_causal_at_the_traced_size_only_is_checked_at_each_reuse(traced):
    """Causal for fewer than 10 queries, open to every key from query 10 on: the plan traced at
    7 serves 9, and at 12 the mask is computed again and found otherwise, so 12 traces anew
    (with its mask). Reused at 12, the causal flag would drop keys eager keeps."""
    nodes = _attention_nodes(PositionMasked(0, open_from=10).eval(), [7, 9, 12], dynamic=True)
    assert len(traced) == 2
    assert sorted(n.attrs["is_causal"] for n in nodes) == [False, True]


class Layered(nn.Module):
    """Three layers of causal attention (PositionMasked's) under one mask built once."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(PositionMasked(0) for _ in range(3))

    def forward(self, x):
        n = x.shape[1]
        pos = torch.arange(n, device=x.device)
        keep = pos[None, :] <= pos[:, None]
        for layer in self.layers:
            q, k, v = (t.view(x.shape[0], n, 2, 16).transpose(1, 2) for t in layer.qkv(x).chunk(3, -1))
            x = x + F.scaled_dot_product_attention(q, k, v, attn_mask=keep).transpose(1, 2).reshape(x.shape)
        return x


def test_layers_sharing_a_mask_decide_once_a_trace_and_check_once_a_new_length(traced, monkeypatch):
    from kiln_ops_builtin.passes import causal_masks
    decisions = []
    decide = causal_masks.implied_causality
    monkeypatch.setattr(causal_masks, "implied_causality", lambda *a: decisions.append(a[1:]) or decide(*a))
    nodes = _attention_nodes(Layered().eval(), [7, 9, 11], dynamic=True)
    assert len(traced) == 1 and len(nodes) == 3 and all(n.attrs["is_causal"] for n in nodes)
    assert [int(q) for q, _ in decisions] == [7, 9, 11]
