"""Torch rules for the fused operator. Priority 10 puts them before the built-in rules for the
same targets; the checks decline what the fused operator does not cover (no weight, or a
normalized shape of more than the last dim), and the built-in rule takes those calls."""
import torch
import torch.nn.functional as F

from kiln import ops
from kiln.frontend.torch import KilnModule, register_function, register_module


def _last_dim_with_weight(input, normalized_shape, weight=None, eps=None) -> bool:
    return weight is not None and len(normalized_shape) == 1


@register_function(F.rms_norm, torch.rms_norm, priority=10, check=_last_dim_with_weight)
def rms_norm(input, normalized_shape, weight=None, eps=None):
    eps = torch.finfo(input.dtype.torch_dtype).eps if eps is None else eps
    return ops.fused_rms_norm(input, weight, eps)


@register_module(torch.nn.RMSNorm, priority=10,
                 check=lambda m, *args: m.weight is not None and len(m.normalized_shape) == 1)
class RMSNorm(KilnModule):
    def __call__(self, x):
        return rms_norm(x, self.torch_module.normalized_shape, self.param("weight"),
                        self.torch_module.eps)
