"""Kiln's log and dumps: the logger `kiln` and the folder `$KILN_DUMP_DIR`.

`KILN_LOG=info` prints to stderr the stages of each compile with their times, the kernels
built and the kernel cache's misses, and tuning results; `KILN_LOG=debug` adds cache hits and
the graphs. Without KILN_LOG the logger is left to the application's logging configuration.

`KILN_DUMP_DIR=/some/folder` keeps, for each graph compiled, a folder `graph-NNN` holding the
fx graph, the FlowGraph before and after each pass, every generated kernel source and the
memory plan (`dump_folder()`).

What the log tells of a compile is also kept as data, in the `CompileRecord` of the compile under
way (`recording()`): each stage's time, kernel cache hits and misses, the templates tuned; the
torch backend makes each compile's summary of it.

This module imports nothing else of Kiln, so every layer may use it.
"""
from __future__ import annotations

import contextlib
import contextvars
import itertools
import logging
import sys
import threading
import time
import warnings
from pathlib import Path

from kiln.settings import current

logger = logging.getLogger("kiln")

LEVELS = {"info": logging.INFO, "debug": logging.DEBUG}

_handler: logging.Handler | None = None
_dumps = itertools.count()
_dump_lock = threading.Lock()


def configure(value: str | None = None) -> None:
    """Send the `kiln` logger to stderr at level `value` ('info' or 'debug'; the setting `log`,
    $KILN_LOG, when None); an empty value leaves logging as the application set it."""
    global _handler
    value = (current().log if value is None else value).strip().lower()
    if not value:
        return
    if value not in LEVELS:
        warnings.warn(f"KILN_LOG={value!r} is not one of {', '.join(LEVELS)}; Kiln logs nothing",
                      stacklevel=2)
        return
    if _handler is None:
        _handler = logging.StreamHandler(sys.stderr)
        _handler.setFormatter(logging.Formatter("kiln %(levelname)s: %(message)s"))
        logger.addHandler(_handler)
    logger.setLevel(LEVELS[value])


class CompileRecord:
    """What one compile did, as its log lines tell it: milliseconds per stage (`stages`), kernel
    cache hits and misses by kind of kernel (`kernel_cache`: {'cpu': {'hits': 2, 'misses': 1}}),
    kernels this process had built already (`kernels_reused`), the templates tuned (`tuned`)
    and the tuning results taken from the cache (`tuning_reused`). The threads working for the
    compile add to it at once."""

    def __init__(self):
        self.stages: dict[str, float] = {}
        self.kernel_cache: dict[str, dict[str, int]] = {}
        self.kernels_reused = 0
        self.tuned: list[dict] = []
        self.tuning_reused = 0
        self._lock = threading.Lock()

    def add_stage(self, name: str, ms: float) -> None:
        """Stage `name` took `ms` milliseconds (more, where it ran before in this compile)."""
        with self._lock:
            self.stages[name] = self.stages.get(name, 0.0) + ms

    def add_cache_lookup(self, kind: str, hit: bool) -> None:
        """A kernel of `kind` ('cpu', 'cuda') was taken from the cache (`hit`) or built."""
        with self._lock:
            counts = self.kernel_cache.setdefault(kind, {"hits": 0, "misses": 0})
            counts["hits" if hit else "misses"] += 1

    def add_kernel_reused(self) -> None:
        """A kernel this process had built already was taken (no cache lookup)."""
        with self._lock:
            self.kernels_reused += 1

    def add_tuned(self, result: dict) -> None:
        """A template was tuned: `result` says which, for what, and what won."""
        with self._lock:
            self.tuned.append(result)

    def add_tuning_reused(self) -> None:
        """A tuning result was taken from the cache."""
        with self._lock:
            self.tuning_reused += 1


_record: contextvars.ContextVar[CompileRecord | None] = contextvars.ContextVar("kiln_compile_record",
                                                                               default=None)


@contextlib.contextmanager
def recording():
    """Keep, in a new CompileRecord (yielded), what the block's compile does: in this thread,
    and in the threads it hands work to in a copy of its context (`contextvars.copy_context`)."""
    record = CompileRecord()
    token = _record.set(record)
    try:
        yield record
    finally:
        _record.reset(token)


def current_record() -> CompileRecord:
    """The record of the compile under way in this context (a throwaway one outside any)."""
    return _record.get() or CompileRecord()


@contextlib.contextmanager
def stage(name: str, detail: str = ""):
    """Log (at info) how long the block took, 'stage NAME [DETAIL]: 12.3 ms', and add it to the
    compile's record."""
    start = time.perf_counter()
    yield
    ms = (time.perf_counter() - start) * 1e3
    logger.info("stage %s%s: %.1f ms", name, f" ({detail})" if detail else "", ms)
    current_record().add_stage(name, ms)


def dump_root() -> Path | None:
    """The setting `dump_dir` ($KILN_DUMP_DIR; None when unset)."""
    root = current().dump_dir
    return Path(root) if root else None


def dump_folder() -> Path | None:
    """A new, numbered folder under $KILN_DUMP_DIR for one compiled graph (None when unset)."""
    root = dump_root()
    if root is None:
        return None
    with _dump_lock:
        while True:
            folder = root / f"graph-{next(_dumps):03d}"
            if not folder.exists():
                break
        folder.mkdir(parents=True)
    logger.info("dumping graph %s", folder)
    return folder


configure()
