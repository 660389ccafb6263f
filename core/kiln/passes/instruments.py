"""Pass instruments: callbacks around every pass that runs under a `PassContext`.

Shipped: `PrintGraph` (the graph before and/or after each pass), `PassTiming` (seconds per
pass) and `DumpGraph` (each stage written to a numbered file of a directory).
"""
from __future__ import annotations

import os
import sys
import time

from kiln.table import format_table


class PassInstrument:
    """Base class: override the callbacks you need."""

    def enter_pass_ctx(self, ctx) -> None:
        """The PassContext holding this instrument was entered."""

    def exit_pass_ctx(self, ctx) -> None:
        """The PassContext holding this instrument was left."""

    def run_before_pass(self, graph, graph_pass) -> None:
        """`graph_pass` is about to transform `graph`."""

    def run_after_pass(self, graph, graph_pass) -> None:
        """`graph_pass` produced `graph`."""


class PrintGraph(PassInstrument):
    """Print the graph before and/or after each pass."""

    def __init__(self, before: bool = True, after: bool = True, file=None):
        self.before, self.after, self.file = before, after, file

    def _print(self, when: str, graph, graph_pass) -> None:
        print(f"# {when} {graph_pass.name}\n{graph}", file=self.file or sys.stdout)

    def run_before_pass(self, graph, graph_pass) -> None:
        if self.before:
            self._print("before", graph, graph_pass)

    def run_after_pass(self, graph, graph_pass) -> None:
        if self.after:
            self._print("after", graph, graph_pass)


class PassTiming(PassInstrument):
    """Time each pass; `timings` lists (pass name, seconds) in the order they ran."""

    def __init__(self):
        self.timings: list[tuple[str, float]] = []
        self._started: list[float] = []

    def run_before_pass(self, graph, graph_pass) -> None:
        self._started.append(time.perf_counter())

    def run_after_pass(self, graph, graph_pass) -> None:
        self.timings.append((graph_pass.name, time.perf_counter() - self._started.pop()))

    def render(self) -> str:
        """A table of the passes run: each one's name and milliseconds."""
        return format_table([(name, f"{sec * 1e3:.3f}") for name, sec in self.timings],
                            ("pass", "ms"), align=("left", "right"))


class DumpGraph(PassInstrument):
    """Write each stage to `directory`, one numbered file per stage: the graph a pipeline
    starts from (`00_input.txt`), then the graph after each pass (`01_<pass>.txt`, ...).
    Numbering goes on across runs, so dumps of several graphs never overwrite each other."""

    def __init__(self, directory: str):
        self.directory = directory
        self.stage = 0
        self.depth = 0

    def _write(self, name: str, graph) -> None:
        os.makedirs(self.directory, exist_ok=True)
        path = os.path.join(self.directory, f"{self.stage:02d}_{name}.txt")
        with open(path, "w") as f:
            f.write(f"{graph}\n")
        self.stage += 1

    def run_before_pass(self, graph, graph_pass) -> None:
        if self.depth == 0:
            self._write("input", graph)
        self.depth += 1

    def run_after_pass(self, graph, graph_pass) -> None:
        self.depth -= 1
        self._write(graph_pass.name, graph)
