"""`CompileSession`: what one compile of a graph holds, and the scheduler's answers for it.

A session holds the target (the device the graph runs on), the plugins' contributions it
resolved (a `kiln.plugins.Registry`: the installed plugins' unless given) and the settings
(`kiln.settings.Settings`: those in effect when it opened unless given). Graph passes reach the
open one as `ctx.session` (`kiln.passes.PassContext.session`; a pass called outside any
session opens one for its graph) and ask it which templates would schedule a task, instead of
asking the scheduler and the global registry themselves:

    with CompileSession(device).opened() as session:
        best = session.template(node.task, node.device)

`templates` is the scheduler's own query (`kiln.schedule.choose.schedules_for`), for the GPU
architecture of the device (any architecture where no GPU is here: graphs of CUDA symbols are
planned for NVRTC checks too), answered once per task in a session.
"""
from __future__ import annotations

import contextvars
from contextlib import contextmanager
from typing import Iterator

from kiln.device import Device
from kiln.ir.compute import Task
from kiln.plugins.registry import Registry, registry
from kiln.schedule.choose import Template, device_arch, schedules_for, templates_for
from kiln.settings import Settings, current

_open: contextvars.ContextVar[CompileSession | None] = contextvars.ContextVar("kiln_session", default=None)


class CompileSession:
    """The target, plugins and settings of one compile (see the module docs)."""

    def __init__(self, target: Device, settings: Settings | None = None, plugins: Registry | None = None):
        self.target = target
        self.settings = settings or current()
        self.plugins = plugins or registry()
        self._archs: dict[Device, int | None] = {}
        self._found: dict[tuple, tuple[Task, list[Template]]] = {}

    @staticmethod
    def current() -> CompileSession | None:
        """The session open in this context, or None."""
        return _open.get()

    @contextmanager
    def opened(self) -> Iterator[CompileSession]:
        """A context in which this session is `current()`."""
        token = _open.set(self)
        try:
            yield self
        finally:
            _open.reset(token)

    def arch(self, device: Device) -> int | None:
        """`device`'s GPU architecture (`kiln.schedule.device_arch`), asked once."""
        if device not in self._archs:
            self._archs[device] = device_arch(device)
        return self._archs[device]

    def contributed(self, operator: str, target: str | None = None) -> list[Template]:
        """The templates the plugins contribute for `operator` on `target` (the session's
        target's kind when None), for any architecture, whether or not they take a given task."""
        return templates_for(operator, target or self.target.kind, plugins=self.plugins)

    def templates(self, task: Task, device: Device | None = None) -> list[Template]:
        """The templates that take `task` on `device` (the target when None), highest priority
        first: the first is the one that would schedule it."""
        device = device or self.target
        key = (id(task), device)
        if key not in self._found:       # the task is kept with its answer: its id stays its own
            self._found[key] = (task, schedules_for(task, device.kind, self.arch(device), self.plugins))
        return self._found[key][1]

    def template(self, task: Task, device: Device | None = None) -> Template | None:
        """The template that would schedule `task` on `device` (the target when None), or None
        where the auto-scheduler would."""
        found = self.templates(task, device)
        return found[0] if found else None
