"""`unmapped_operators(model, *inputs)`: the torch operators of a model that no rule maps."""
from __future__ import annotations

from collections import Counter

import torch

from kiln.frontend.torch.errors import UnmappedOperator
from kiln.frontend.torch.interpreter import Interpreter


def unmapped_operators(model, *example_inputs, **example_kwargs) -> list[UnmappedOperator]:
    """Capture `model` with dynamo on the example inputs and list, without compiling anything,
    every target of its graphs that no rule maps (once each, sorted, counts summed)."""
    found: list[UnmappedOperator] = []

    def collect(gm, _inputs):
        found.extend(Interpreter(gm).unmapped())
        return gm.forward

    with torch.no_grad():
        torch.compile(model, backend=collect, dynamic=False)(*example_inputs, **example_kwargs)
    counts, examples = Counter(), {}
    for op in found:
        counts[(op.name, op.kind)] += op.count
        examples.setdefault((op.name, op.kind), op.example)
    return [UnmappedOperator(name, kind, counts[(name, kind)], examples[(name, kind)])
            for name, kind in sorted(counts)]
