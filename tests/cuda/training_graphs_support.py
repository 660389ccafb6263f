"""What the CUDA tests of training through captured graphs share."""
import torch


def assert_same_gradients(model, reference):
    """Each parameter's gradient of `model` is its twin's in `reference` (the same model run eagerly)."""
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-4, rtol=1e-4, msg=lambda m: f"{name}: {m}")
