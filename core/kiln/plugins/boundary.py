"""The error boundary around a plugin's own code (its import and its hooks).

Whatever a plugin raises there, `SystemExit` and `KeyboardInterrupt` included, becomes a load
error recorded against that plugin: neither the other plugins nor the user's process go down
with it. A real Ctrl-C is told apart from a plugin raising KeyboardInterrupt itself: while
plugin code runs in the main thread a SIGINT handler notes the signal, and a KeyboardInterrupt
that follows a noted signal propagates as usual.
"""
from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Callable


def describe(exc: BaseException) -> str:
    """'RuntimeError: broken', 'SystemExit: 3', 'KeyboardInterrupt'."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


@contextmanager
def _sigint_watch():
    """Yields a list that gets an entry when SIGINT arrives (main thread only; elsewhere no
    signal is delivered to the running code, so the list stays empty)."""
    seen: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield seen
        return
    previous = signal.getsignal(signal.SIGINT)

    def note(signum, frame):
        seen.append(signum)
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:
            raise KeyboardInterrupt

    try:
        signal.signal(signal.SIGINT, note)
    except ValueError:  # not the main interpreter: no handler can be set
        yield seen
        return
    try:
        yield seen
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.SIG_DFL)


def guarded(fn: Callable, *args):
    """`(fn(*args), None)`, or `(None, description)` when `fn` raised anything but a real
    Ctrl-C (which propagates)."""
    with _sigint_watch() as interrupted:
        try:
            return fn(*args), None
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt) and interrupted:
                raise
            return None, describe(exc)
