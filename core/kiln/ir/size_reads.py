"""What a computation read of the values of its symbolic sizes (`kiln.ir.size.SymSize`).

Inside `recording()`, each comparison of a SymSize with an int or another SymSize is kept as a
guard: the operator, the two sides as polynomials and the answer (`kiln.ir.size.guards_hold`
asks them again at other sizes); a decision on values computed from sizes alone is kept as a
check that computes them again at other sizes (`note_check`). Any other read of a value (`int()`, hashing, formatting,
`/`, bit operations, a comparison with a float, a size variable's value in the IR) marks the
record as `read`, naming where: what was computed may then depend on the value itself, and
holds at that value only. A computation that read nothing but through its guards takes the
same decisions at every size where the guards answer the same.

Reads that Python does not route through the SymSize's methods are not seen: C code taking it
as an int (an index into a list, `range()`, an argument of torch or ctypes). Those a compile
makes are a kernel run while tracing, which `kiln.graph.operator.run_task` notes as a read, and
torch tensors made from sizes while tracing, whose shapes the torch frontend's check of each
node against dynamo's symbolic shapes compares with the symbolic sizes (guards that hold at the
traced value only).

Caches that outlive one computation hold what an earlier one decided, whose reads this record
never saw: while recording, `kiln.graph.operator.Recent` keeps its entries in the record
(`SizeReads.cache`), so that a recorded computation decides everything again itself.
"""
from __future__ import annotations

import contextlib
import contextvars
import sys

_current: contextvars.ContextVar[SizeReads | None] = contextvars.ContextVar("kiln_size_reads", default=None)


class SizeReads:
    """The guards a recorded computation took (a set of (operator name, polynomial, polynomial,
    answer)), where it first read a value otherwise (`read`, None if nowhere) and the caches it
    filled (by the id of their owner)."""

    def __init__(self):
        self.guards: set[tuple] = set()
        self.read: str | None = None
        self.caches: dict[int, dict] = {}

    def cache(self, owner) -> dict:
        """The entries of the cache `owner` that this recording filled."""
        return self.caches.setdefault(id(owner), {})


@contextlib.contextmanager
def recording():
    """A new SizeReads, filled by what the block (in this context) reads of symbolic sizes."""
    reads = SizeReads()
    token = _current.set(reads)
    try:
        yield reads
    finally:
        _current.reset(token)


def current() -> SizeReads | None:
    """The SizeReads being recorded in this context, or None."""
    return _current.get()


def note_guard(op: str, p: tuple, q: tuple, answer: bool) -> None:
    """Record the comparison `p op q` of two polynomials, answered `answer`."""
    reads = _current.get()
    if reads is not None:
        reads.guards.add((op, p, q, answer))


def note_check(check, names) -> None:
    """Record a decision that comparisons of sizes do not capture (a property of values computed
    from the sizes alone, such as a mask a graph builds from positions): `check(values)` (name ->
    int, the size variables `names`) says whether the decision made here would be made at
    `values` too. `kiln.ir.size.guards_hold` calls it with the other guards."""
    reads = _current.get()
    if reads is not None:
        reads.guards.add(("check", check, tuple(sorted(names)), True))


def note_read(what: str) -> None:
    """Record a read of a size's value other than a comparison (`what`: how it was read)."""
    reads = _current.get()
    if reads is not None and reads.read is None:
        reads.read = f"{what} at {_caller()}"


def _caller() -> str:
    """The innermost frame outside the modules that note reads (kiln.ir.size, kiln.ir.expr and
    this one), as 'file:line in function'."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.endswith(("/ir/size.py", "/ir/expr.py", "/ir/size_reads.py")):
        frame = frame.f_back
    if frame is None:
        return "?"
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"
