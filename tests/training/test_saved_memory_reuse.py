"""A consuming backward (`kiln.runtime.cuda_graph.capture`, `reused`) takes back the memory of
the values the forward saved for it once it has read them; the forward's capture allocates
those values side by side in one block, in the order it writes them
(`CompiledGraph.workspace_set(together=...)`), so that the values the backward has read make
long free stretches. Checked here on the CPU with the runtime pieces a capture uses, on the
graphs of one training step of a small Llama-style model and of a ResNet stem: laid side by
side, the saved values hold more of the Llama-style backward's workspace and gradients than laid
apart (where only a buffer that fits one saved value could go), and never less, and the backward
run in that memory computes, to the bit, the gradients of the step run without it."""
import pytest
import torch
from torch import nn

from kiln.frontend.torch import backend
from kiln.runtime.compiled_graph import lent_layout

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=512, attn_implementation="eager", use_cache=False)
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, 512, (2, 32))
    return model, lambda m: m(ids).logits.float().square().mean()


def _stem():
    model = nn.Sequential(nn.Conv2d(3, 16, 7, 2, 3, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
                          nn.MaxPool2d(3, 2, 1), nn.Conv2d(16, 32, 3, 1, 1, bias=False), nn.BatchNorm2d(32),
                          nn.ReLU(), nn.Conv2d(32, 64, 3, 2, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))
    images = torch.randn(2, 3, 64, 64)
    return model, lambda m: m(images).square().mean()


def _recorded_step(model, loss_of, monkeypatch):
    """One compiled training step, with each CompiledRun call's (run, inputs, outputs)."""
    calls = []
    call = backend.CompiledRun.__call__

    def recording(self, args):
        outs = call(self, args)
        flat = [o for o in (outs if isinstance(outs, (tuple, list)) else [outs]) if isinstance(o, torch.Tensor)]
        calls.append((self, [args[p] for p in self.positions], flat))
        return outs

    monkeypatch.setattr(backend.CompiledRun, "__call__", recording)
    compiled = torch.compile(model, backend="kiln", options={"graph_cache": False})
    loss_of(compiled).backward()
    [(forward, f_inputs, f_outs)] = [c for c in calls if c[0].lent and len(c[0].lent) < len(c[0].returned)]
    [(backward, b_inputs, grads)] = [c for c in calls if c[0] is not forward]
    return forward, f_inputs, f_outs, backward, b_inputs, grads


@pytest.mark.parametrize("case, fewer", [(_llama, True), (_stem, False)])
def test_the_backward_puts_more_gradients_in_saved_values_laid_side_by_side(case, fewer, monkeypatch):
    torch.manual_seed(0)
    model, loss_of = case()
    forward, f_inputs, f_outs, backward, b_inputs, grads = _recorded_step(model, loss_of, monkeypatch)
    fwd, bwd = forward.compiled, backward.compiled
    saved_slots = [fwd.outputs[k] for k in forward.lent]
    # the forward run as its capture runs it: the saved values in one block
    workspace = fwd.workspace_set(together=saved_slots)
    outs = fwd.run(f_inputs, workspace)
    made = [k for k in forward.lent if fwd.outputs[k] in workspace.together]
    assert len({outs[k].untyped_storage().data_ptr() for k in made}) == 1
    # the backward's inputs that are saved values the forward computed, now in that block
    by_address = {f_outs[k].data_ptr(): outs[k] for k in made}
    inputs = [by_address.get(t.data_ptr(), t) if t.numel() else t for t in b_inputs]
    together = {bwd.inputs[j]: t for j, t in enumerate(inputs) if t is not b_inputs[j] and t.is_contiguous()}
    apart = {slot: t.clone() for slot, t in together.items()}
    gradients = [s for s in bwd.allocated_outputs if s not in bwd.views]

    def beside(reused) -> int:
        """The bytes the backward takes beyond the saved values: its workspace and the gradients
        that are not in their memory."""
        layout = lent_layout(reused)
        placed = bwd.placed_in_inputs(frozenset(), layout)
        return (sum(p.size for p in bwd.plans_with(frozenset(), layout).values())
                + sum(bwd.buffers[s].nbytes for s in gradients if s not in placed))

    # the embedding's gradient, computed last, fits no one saved value; on the CPU the stem's
    # backward needs its largest buffers while the values it could use are still read
    assert beside(together) < beside(apart) if fewer else beside(together) <= beside(apart)
    got = bwd.run(inputs, bwd.workspace_set(reused=together))
    for g, want in zip(got, grads):
        torch.testing.assert_close(g, want, rtol=0, atol=0)
