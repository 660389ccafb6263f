"""Progress of long work (tuning a template) on stderr.

Where stderr is a terminal, a tqdm bar counts the work's steps, with the time left, and gives
way to one line when the work is done. Anywhere else (a log file, a pipe) only that line is
written, one per piece of work: never a line rewritten in place. `KILN_PROGRESS=0` silences
both; the `kiln` logger (`KILN_LOG`) is left as it is.

This module imports nothing else of Kiln, so every layer may use it.
"""
from __future__ import annotations

import sys
import time

from tqdm import tqdm

from kiln.settings import current


def shown() -> bool:
    """Whether progress is written at all: stderr exists and the setting `progress` (KILN_PROGRESS=0 turns it off) is on."""
    return sys.stderr is not None and current().progress


class Progress:
    """One piece of work of `total` steps (each a `unit`: 'candidate'), named `description`
    ('tuning gemm_sm90'); a context manager. Call `step()` as each step ends and
    `done(summary)` when the work has succeeded: it writes 'kiln: SUMMARY (N units, S s)'."""

    def __init__(self, total: int, description: str, unit: str = "step"):
        self.total, self.unit = total, unit
        self.stream = sys.stderr if shown() else None
        self.started = time.perf_counter()
        on_terminal = self.stream is not None and self.stream.isatty()
        self.bar = tqdm(total=total, desc=f"kiln: {description}", unit=unit, leave=False,
                        file=self.stream, dynamic_ncols=True) if on_terminal else None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.close()

    def step(self) -> None:
        """One more step is done."""
        if self.bar is not None:
            self.bar.update()

    def done(self, summary: str) -> float:
        """Close the bar and write the work's one line: `summary`, the steps and the seconds;
        return the seconds the work took."""
        seconds = time.perf_counter() - self.started
        if self.bar is not None:
            self.bar.close()
        if self.stream is not None:
            units = self.unit if self.total == 1 else f"{self.unit}s"
            self.stream.write(f"kiln: {summary} ({self.total} {units}, {seconds:.1f} s)\n")
            self.stream.flush()
        return seconds
