"""Every table Kiln prints is drawn by `kiln.table` (tabulate): no module of the core pads
columns by hand."""
from __future__ import annotations

import re
from pathlib import Path

import kiln
from kiln.table import format_table, numbered_source

PADDING = re.compile(r"""
      \.(?:ljust|rjust|center)\(                       # str's padding methods
    | \{[^{}'"]*:[^{}'"]?[<>^=](?:\d|\{)                # a field aligned in a width: {x:<10}, {x:>{w}}
    | \{[^{}:'"]+:[ +-]?\#?[1-9]\d*(?:\.\d+)?[a-zA-Z%]?\}   # a field of a width: {n:5d}, {t:9.3f}
    | %-?[1-9]\d*(?:\.\d+)?[sdfge]                      # printf widths: %-10s, %8.3f
""", re.VERBOSE)


def padded_lines(text: str) -> list[str]:
    """The lines of `text` that pad a value to a column width."""
    return [line.strip() for line in text.splitlines() if PADDING.search(line)]


def test_no_module_of_the_core_pads_columns_by_hand():
    root = Path(kiln.__file__).parent
    found = [f"{path.relative_to(root.parent)}: {line}" for path in sorted(root.rglob("*.py"))
             for line in padded_lines(path.read_text())]
    assert not found, "tables formatted by hand (use kiln.table.format_table):\n" + "\n".join(found)


def test_the_scan_finds_what_it_looks_for():
    """Known hand-made tables are caught, and what only looks like one is not."""
    caught = ['"  ".join(c.ljust(w) for c, w in zip(r, widths))', 'f"  {o.name:<{width}}  {o.kind:<8}"',
              'f"{name:<28} {sec * 1e3:9.3f} ms"', 'f"slot {slot:4d}"', '"%-10s %s" % (a, b)',
              "f'{x:>12}'"]
    innocent = ['f"graph-{n:03d}"', 'f"{error:.1e}"', 'f"{{ {body} }}"', 'x[1:-1]', 'f"{a}:{b}"',
                '"100%"', 'f"{value!r}"', 'f"{n % 4}"']
    assert [padded_lines(line) != [] for line in caught] == [True] * len(caught)
    assert [padded_lines(line) for line in innocent] == [[]] * len(innocent)


def test_tables_have_a_header_a_rule_and_aligned_columns():
    text = format_table([("relu", 1, "1.0e-05"), ("layer_norm", 12, "")], ("operator", "count", "error"),
                        align=("left", "right", "left"))
    lines = text.splitlines()
    assert lines[0].split() == ["operator", "count", "error"]
    assert set(lines[1]) == {"-", " "}
    assert lines[2].split() == ["relu", "1", "1.0e-05"], "cells are shown as they are, not parsed"
    assert lines[3].split() == ["layer_norm", "12"]
    assert lines[2].index("1 ") == lines[3].index("12") + 1, "numbers right-aligned"
    assert format_table([("a", "b")], indent="  ") == "  a  b"
    assert [line.split() for line in format_table([("a", "b")], ("x", "y"), rule=False).splitlines()] \
        == [["x", "y"], ["a", "b"]]


def test_numbered_source_keeps_indentation():
    listing = numbered_source("\n".join(["int f() {", "  return 1;", "}"] * 4)).splitlines()
    assert listing[1] == " 2 |   return 1;" and listing[11] == "12 | }"
