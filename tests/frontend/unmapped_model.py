"""A model using torch operators that no Kiln rule maps (for the unmapped-operator tests and
`kiln unmapped tests/frontend/unmapped_model.py:example`)."""
import torch
from torch import nn


class PartlyMapped(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(6, 6)

    def forward(self, x):
        y = torch.special.bessel_j0(self.linear(x))
        y = torch.special.bessel_j0(y.relu()) + torch.special.i0(x)
        return y.i0().softmax(-1)


def example():
    """The model and example inputs, as `kiln unmapped MODULE:CALLABLE` expects."""
    torch.manual_seed(0)
    return PartlyMapped().eval(), (torch.randn(3, 6),)
