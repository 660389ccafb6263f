"""A Llama with transformers' eager attention trained through Kiln on a GPU under bfloat16
autocast: the `eager_attention` rewrite makes each layer's attention one
scaled_dot_product_attention, which Kiln's fused training pair computes, so the forward saves no
[B, H, L, L] probabilities; the gradients stay within twice eager's own error against a float64
reference (plus a little)."""
import copy

import pytest
import torch

from kiln.frontend.torch import KilnFunction
from kiln.frontend.torch.memory import graph_memory

pytestmark = pytest.mark.cuda

LENGTH = 96


def _llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=500,
                                      attn_implementation="eager", use_cache=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).cuda()


def _error(got, want):
    return ((got.double() - want).norm() / want.norm()).item()


def test_eager_attention_trains_without_saved_probabilities():
    model = _llama()
    reference, eager = copy.deepcopy(model).double(), copy.deepcopy(model)
    ids = torch.randint(0, 500, (2, LENGTH), device="cuda")
    weights = torch.randn(2, LENGTH, 500, device="cuda")
    (reference(ids).logits * weights.double()).sum().backward()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        (eager(ids).logits.float() * weights).sum().backward()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="kiln", options={"graph_cache": False})
    before = set(KilnFunction.live())
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = (compiled(ids).logits.float() * weights).sum()
    loss.backward()
    saved = [v.signature for f in KilnFunction.live() if f not in before and f.lent_from
             for m in graph_memory(f) for v in m.largest_saved]
    assert saved and not [s for s in saved if f"{LENGTH}, {LENGTH}]" in s], saved
    for (name, p), e, r in zip(model.named_parameters(), eager.parameters(), reference.parameters()):
        assert _error(p.grad, r.grad) <= 2 * _error(e.grad, r.grad) + 2e-3, name
