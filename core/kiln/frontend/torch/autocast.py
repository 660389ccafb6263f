"""torch.autocast regions in dynamo graphs: the dtypes PyTorch chose, applied to the inputs.

Inside an autocast region (entered around the compiled call, or by `_enter_autocast` /
`_exit_autocast` nodes in the graph) PyTorch runs some operators in a lower precision (matmul,
linear, convolution), some in float32 (softmax, norms, reductions) and promotes others to their
widest input. Dynamo records the dtype each node produced. So inside a region, a node whose
floating inputs differ from the floating dtype PyTorch produced gets those inputs cast to it
first: float32 weights to bfloat16 for a linear, bfloat16 activations to float32 for a softmax.
That is the cast autocast makes (autocast leaves float64 alone, and so does this); outside
regions nothing is cast, and a dtype that differs from PyTorch's stays an error.
"""
from __future__ import annotations

import torch
from torch.fx.node import map_aggregate

from kiln.graph import Role
from kiln.plugins import registry
from kiln.tensor import Tensor

ENTER, EXIT = torch.amp.autocast_mode._enter_autocast, torch.amp.autocast_mode._exit_autocast
REGION_CALLS = frozenset({ENTER, EXIT})
"""The graph's calls that open and close autocast regions."""


def ambient() -> bool:
    """Whether autocast is on for any device where the graph is compiled (at its first call)."""
    return any(torch.is_autocast_enabled(d) for d in ("cpu", "cuda"))


class Regions:
    """The stack of autocast regions while a graph is interpreted, outermost the ambient state."""

    def __init__(self):
        self.enabled = [ambient()]

    def call(self, target, args) -> None:
        """Open (`_enter_autocast(device, dtype, enabled, cache)`) or close a region."""
        if target is ENTER:
            self.enabled.append(bool(args[2]))
        elif len(self.enabled) > 1:
            self.enabled.pop()

    def cast_inputs(self, expected, args, kwargs):
        """`args` and `kwargs` with floating tensors cast to the one floating dtype of PyTorch's
        results `expected` (float64 tensors left alone), inside a region; as they are otherwise."""
        if not self.enabled[-1]:
            return args, kwargs
        found = set()
        map_aggregate(expected, lambda m: found.add(m.dtype) if isinstance(m, torch.Tensor)
                      and m.dtype.is_floating_point else m)
        if len(found) != 1 or found == {torch.float64}:
            return args, kwargs
        target = found.pop()
        cast = registry().implementing(Role.CAST)

        def convert(v):
            if (isinstance(v, Tensor) and v.dtype.is_float and v.dtype.torch_dtype not in (target, torch.float64)):
                return cast(v, target)
            return v
        return map_aggregate((args, kwargs), convert)
