"""Training steps of a small ResNet (convolutions, batch norm in training mode, in-place ReLUs,
residual adds, max and adaptive average pooling, a linear head, cross-entropy) through
torch.compile(backend="kiln"), NCHW and channels_last (model and images, as users train CNNs),
against eager: losses, every gradient, and the parameters and batch norm running statistics
after the optimizer steps."""
import pytest
import torch

from training_support import resnet_case, train

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fresh_dynamo")]

STEPS = 2


@pytest.mark.parametrize("memory_format, shape, optimizer", [
    (torch.contiguous_format, (4, 3, 11, 13), "sgd"),
    (torch.channels_last, (4, 3, 11, 13), "adamw"),
    (torch.channels_last, (3, 3, 9, 7), "sgd"),
    (torch.channels_last, (2, 3, 16, 15), "adamw"),
], ids=["nchw-11x13-sgd", "nhwc-11x13-adamw", "nhwc-9x7-sgd", "nhwc-16x15-adamw"])
def test_training_steps_match_eager(memory_format, shape, optimizer):
    model, batches = resnet_case(shape=shape, memory_format=memory_format)
    # the stem convolution's bias, before batch norm, has no gradient in exact arithmetic: its
    # rounding noise would move it by AdamW's whole step either way (and the running mean after)
    model.stem[0].bias.requires_grad_(False)
    eager = train(model, batches, optimizer, STEPS)
    torch._dynamo.reset()
    kiln = train(model, batches, optimizer, STEPS, compile_with="kiln")
    assert kiln.kiln_graphs >= 2, "Kiln must compile and run the forward and the backward"

    torch.testing.assert_close(kiln.losses, eager.losses, rtol=1e-5, atol=0)
    assert set(kiln.first_grads) == {n for n, p in model.named_parameters() if p.requires_grad}
    for name, expected in eager.first_grads.items():
        torch.testing.assert_close(kiln.first_grads[name], expected, rtol=1e-4, atol=1e-6,
                                   msg=lambda m: f"gradient of {name} after step 1: {m}")
    assert any("running_var" in n for n in eager.state)
    for name, expected in eager.state.items():
        torch.testing.assert_close(kiln.state[name], expected, rtol=1e-4, atol=1e-6,
                                   msg=lambda m: f"{name} after {STEPS} steps: {m}")
