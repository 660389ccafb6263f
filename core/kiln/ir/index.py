"""Index arithmetic shared by operators, schedules and templates."""
from __future__ import annotations

from typing import Sequence

from kiln import dtypes
from kiln.ir.expr import Const, Expr, as_expr
from kiln.ir.simplify import simplify


def unravel(flat, extents: Sequence[int]) -> list[Expr]:
    """The row-major multi-index (one simplified expression per extent) of the flat index
    `flat` (an expression or an int) in a shape of `extents`; extent-1 dims get index 0."""
    flat = as_expr(flat, dtypes.int64)
    index, inner = [], 1
    for size in reversed(list(extents)):
        index.append(Const(0, dtypes.int64) if size == 1 else simplify((flat // inner) % size))
        inner *= size
    return index[::-1]
