"""`PassContext`: what graph passes run under (opt level, required and disabled passes,
config, instruments), and the compile session they ask (`PassContext.session`).

    with kiln.PassContext(opt_level=1, disabled_passes=["fuse_operators"],
                          instruments=[PassTiming()]):
        graph = kiln.graph.optimize(graph)

Contexts nest: a setting not given is taken from the enclosing context (config keys one by
one: an entered context's config changes the settings of what runs inside it), so a library can
set config while the user's opt level and instruments still apply.
`PassContext.current()` is the innermost one of this thread (a default one outside any `with`).
`config` changes settings (`kiln.settings.Settings`, by field name) while the context is
entered: passes read them from their session's `settings`.
"""
from __future__ import annotations

import threading
from contextlib import nullcontext
from dataclasses import fields
from typing import Iterable

from kiln.schedule.session import CompileSession
from kiln.settings import Settings, patch

_local = threading.local()


class PassContext:
    """The settings of one optimization run.

    A pass runs when its name is in `required_passes`, or when it is not in `disabled_passes`
    and its opt level is at most `opt_level` (2 unless an enclosing context says otherwise).
    `config` changes settings by name (`kiln.settings.Settings`: `{"use_fp16": True}`) while
    the context is entered; `self.config` holds those of the enclosing contexts too. Passes
    read settings from `ctx.session.settings`. `instruments` watch every pass that runs (see
    `kiln.passes.instruments`).
    """

    def __init__(self, opt_level: int | None = None, required_passes: Iterable[str] | None = None,
                 disabled_passes: Iterable[str] | None = None, config: dict | None = None,
                 instruments: Iterable | None = None):
        known = [f.name for f in fields(Settings)]
        unknown = set(config or {}) - set(known)
        if unknown:
            raise KeyError(f"unknown PassContext config key(s): {', '.join(sorted(unknown))}; "
                           f"known: {', '.join(known)}")
        stack = getattr(_local, "stack", None)
        outer = stack[-1] if stack else None
        self.opt_level = opt_level if opt_level is not None else (outer.opt_level if outer else 2)
        self.required_passes = frozenset(required_passes if required_passes is not None else
                                         (outer.required_passes if outer else ()))
        self.disabled_passes = frozenset(disabled_passes if disabled_passes is not None else
                                         (outer.disabled_passes if outer else ()))
        self.own_config = dict(config or {})
        self.config = {**(outer.config if outer else {}), **self.own_config}
        self.instruments = list(instruments if instruments is not None else
                                (outer.instruments if outer else ()))

    def pass_enabled(self, graph_pass) -> bool:
        """Whether `graph_pass` runs under this context."""
        if graph_pass.name in self.required_passes:
            return True
        if graph_pass.name in self.disabled_passes:
            return False
        return graph_pass.opt_level <= self.opt_level

    @property
    def session(self) -> CompileSession | None:
        """The compile session open here (`CompileSession.current()`): a pass running asks it
        for its settings and for the templates that would schedule a task."""
        return CompileSession.current()

    @staticmethod
    def current() -> "PassContext":
        """The innermost active context of this thread, or a default one."""
        stack = getattr(_local, "stack", None)
        return stack[-1] if stack else PassContext()

    def __enter__(self) -> "PassContext":
        self._patched = patch(**self.own_config) if self.own_config else nullcontext()
        self._patched.__enter__()
        _local.__dict__.setdefault("stack", []).append(self)
        for inst in self.instruments:
            inst.enter_pass_ctx(self)
        return self

    def __exit__(self, *exc) -> None:
        for inst in self.instruments:
            inst.exit_pass_ctx(self)
        _local.stack.pop()
        self._patched.__exit__(*exc)

    def __repr__(self) -> str:
        return (f"PassContext(opt_level={self.opt_level}, required={sorted(self.required_passes)}, "
                f"disabled={sorted(self.disabled_passes)}, config={self.config})")
