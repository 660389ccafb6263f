"""A compiled graph's run as data (`RunRecord`): what the graph cache and `kiln.save` keep.

A record holds the `kiln.runtime.plan.Plan` and what the backend's `CompiledRun` needs besides
it: which of the graph's arguments are the plan's inputs, where its outputs go in the graph's
output structure, and which inputs its last outputs are written back to; and what identifies
the compile that made it: its whole-graph key (`kiln.frontend.torch.graph_key`), under which
the graph cache and `kiln.load(path, model=...)` find it, and the constants whose values it
read. `dumps` and `loads` are the plan's own (`kiln.runtime.plan`), taught these classes.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kiln.runtime import plan


class Output:
    """Marks where a graph output goes in an output structure."""


@dataclass
class RunRecord:
    """The plan, the positions of the graph's arguments that are its inputs, the output
    structure (`Output` where a graph output goes, plain values as they are), the positions of
    the inputs the last outputs are written back to (inputs the graph changes in place), the
    inputs copied to a device first (by position among the plan's inputs: CPU scalars of a
    graph on a GPU), the outputs a CUDA graph lends (a training forward's saved values) and the
    settings deciding whether some operator of the traced graph runs on TF32
    (`kiln.passes.tf32.permissions`: the plan depends on them); the whole-graph key of the
    compile that made the plan (None where the graph could not be keyed) and the positions of the
    graph's constants whose values that compile read (folded, or read by a rule or a pass: a
    call with other values of those needs another plan)."""

    plan: plan.Plan
    positions: list[int]
    structure: object
    writeback: list[int]
    moves: dict[int, str] = field(default_factory=dict)
    lent: list[int] = field(default_factory=list)
    permissions: tuple[str, ...] = ()
    key: str | None = None
    read: list[int] = field(default_factory=list)


def dumps(record) -> bytes:
    """`record` (plain containers holding RunRecords, tensors and plain values) as bytes."""
    return plan.dumps(record)


def loads(data):
    """What `dumps` wrote into `data` (bytes, or any buffer), building only plain values,
    tensors and the runtime's and these classes (see `kiln.runtime.plan`)."""
    return plan.loads(data, classes=(RunRecord, Output))
