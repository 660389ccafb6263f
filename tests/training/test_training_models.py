"""20 optimizer steps of tiny models through torch.compile(backend="kiln") against eager: the
forward and backward graphs go through AOTAutograd and are compiled by Kiln."""
import pytest
import torch

from training_support import bert_case, llama_case, resnet_case, train

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

CASES = {"resnet": resnet_case, "bert": bert_case, "llama": llama_case}
STEPS = 20


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_training_steps_match_eager(case, optimizer):
    model, batches = CASES[case]()
    eager = train(model, batches, optimizer, STEPS)
    torch._dynamo.reset()
    kiln = train(model, batches, optimizer, STEPS, compile_with="kiln")
    assert kiln.kiln_graphs >= 2, "Kiln must compile and run the forward and the backward"

    assert set(kiln.first_grads) == set(eager.first_grads) == {
        n for n, p in model.named_parameters() if p.requires_grad}
    scale = max(g.abs().max().item() for g in eager.first_grads.values())
    for name, expected in eager.first_grads.items():
        torch.testing.assert_close(kiln.first_grads[name], expected, rtol=1e-4, atol=1e-6 * scale,
                                   msg=lambda m: f"gradient of {name} after step 1: {m}")
    for step, (got, want) in enumerate(zip(kiln.losses, eager.losses)):
        assert abs(got - want) <= 1e-4 * abs(want), f"step {step}: loss {got} vs eager {want}"
    assert eager.losses[-1] < eager.losses[0], "the run must learn something to compare"
