"""Kiln's log and dumps: the logger `kiln` and the folder `$KILN_DUMP_DIR`.

`KILN_LOG=info` prints to stderr the stages of each compile with their times, the kernels
built and the kernel cache's misses, and tuning results; `KILN_LOG=debug` adds cache hits and
the graphs. Without KILN_LOG the logger is left to the application's logging configuration.

`KILN_DUMP_DIR=/some/folder` keeps, for each graph compiled, a folder `graph-NNN` holding the
fx graph, the FlowGraph before and after each pass, every generated kernel source and the
memory plan (`dump_folder()`).

This module imports nothing else of Kiln, so every layer may use it.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import os
import sys
import threading
import time
import warnings
from pathlib import Path

logger = logging.getLogger("kiln")

LEVELS = {"info": logging.INFO, "debug": logging.DEBUG}

_handler: logging.Handler | None = None
_dumps = itertools.count()
_dump_lock = threading.Lock()


def configure(value: str | None = None) -> None:
    """Send the `kiln` logger to stderr at level `value` ('info' or 'debug'; $KILN_LOG when
    None); an empty value leaves logging as the application set it."""
    global _handler
    value = (os.environ.get("KILN_LOG", "") if value is None else value).strip().lower()
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


@contextlib.contextmanager
def stage(name: str, detail: str = ""):
    """Log (at info) how long the block took: 'stage NAME [DETAIL]: 12.3 ms'."""
    start = time.perf_counter()
    yield
    logger.info("stage %s%s: %.1f ms", name, f" ({detail})" if detail else "",
                (time.perf_counter() - start) * 1e3)


def dump_folder() -> Path | None:
    """A new, numbered folder under $KILN_DUMP_DIR for one compiled graph (None when unset)."""
    root = os.environ.get("KILN_DUMP_DIR")
    if not root:
        return None
    with _dump_lock:
        while True:
            folder = Path(root) / f"graph-{next(_dumps):03d}"
            if not folder.exists():
                break
        folder.mkdir(parents=True)
    logger.info("dumping graph %s", folder)
    return folder


configure()
