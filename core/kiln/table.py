"""Every table Kiln prints, drawn by tabulate: the correctness report, `kiln plugins`, `kiln
cache`, `kiln unmapped`, pass timings, the memory plan of a dump, errors that list things, and
the numbered source of a kernel that failed to compile.

This module imports nothing else of Kiln, so every layer may use it.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

from tabulate import DataRow, TableFormat, tabulate

_LISTING = TableFormat(lineabove=None, linebelowheader=None, linebetweenrows=None, linebelow=None,
                       headerrow=DataRow("", " | ", ""), datarow=DataRow("", " | ", ""),
                       padding=0, with_header_hide=None)


def format_table(rows: Iterable[Sequence], headers: Sequence[str] | None = None, *,
                 rule: bool = True, align: Sequence[str] | None = None, indent: str = "") -> str:
    """`rows` as a text table: each cell as `str` shows it, columns two spaces apart,
    left-aligned unless `align` gives 'left' or 'right' per column. With `headers`, a header
    line, then (where `rule`) a line of dashes under each header. Every line starts with
    `indent`."""
    text = tabulate([[str(c) for c in row] for row in rows], headers=headers or (),
                    tablefmt="simple" if headers and rule else "plain", disable_numparse=True,
                    stralign="left", colalign=align)
    return "\n".join(indent + line for line in text.splitlines())


def numbered_source(source: str) -> str:
    """`source` with its line numbers, as compilers quote it: '  12 |     x = y;'."""
    rows = list(enumerate(source.splitlines(), 1))
    return tabulate(rows, tablefmt=_LISTING, colalign=("right", "left"), disable_numparse=True,
                    preserve_whitespace=True)
