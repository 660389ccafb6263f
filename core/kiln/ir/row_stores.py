"""Rows a task stores into an input's buffer itself: a KV cache written at the decoding
position by the kernel that computes the new rows.

A task may compute, among its outputs, rows of new elements and their flat offsets in one of
its inputs (an UpdateRows node's two outputs, `kiln.graph.in_place`: one shape, the offsets
int64, checked in range and distinct). Its attribute ROW_STORES then lists `RowStore`s: the
output `output` is that input with each element of the output `rows` stored at the matching
offset of the output `offsets`. That output's compute says so (a gather over the whole input,
for completeness), but no schedule computes it: the compiled graph gives it the input's own
buffer (`kiln.graph.in_place.stored_into`), and the kernel that writes the later of the rows
and the offsets copies each element of the rows to its offset there, touching nothing else
(`kiln.schedule.store_rows.row_store`). Lowering (`kiln.ir.inline`) materializes nothing of
such an output; the auto-scheduler's general rule of each target writes the stores.
"""
from __future__ import annotations

from dataclasses import dataclass

ROW_STORES = "row_stores"
"""The task attribute listing a task's row stores: ((output, rows, offsets), ...)."""


@dataclass(frozen=True)
class RowStore:
    """A task's output `output`, an input's buffer with the elements of its output `rows` stored
    at the flat offsets its output `offsets` holds (positions among the task's outputs)."""

    output: int
    rows: int
    offsets: int


def row_stores(task) -> tuple[RowStore, ...]:
    """The row stores of `task` (a `kiln.ir.Task`), in the order its attribute lists them."""
    return tuple(RowStore(*s) for s in task.attrs.get(ROW_STORES, ()))


def computed_outputs(task) -> list:
    """The outputs of `task` that its kernels compute: all but those it stores rows into."""
    stored = {s.output for s in row_stores(task)}
    return [out for k, out in enumerate(task.outputs) if k not in stored]
