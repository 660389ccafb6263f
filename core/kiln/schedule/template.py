"""Schedule templates: hand-written kernels for the tasks the auto-scheduler cannot make fast."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


@dataclass
class Template:
    """A schedule template for some operators on one target.

    `render(task, **knobs)` returns `(source, kernel_name, launch)` for the target; `space(level)`
    lists the knob settings to try at tuning level 0, 1 or 2 (level 0: one default).
    `applies(task)` may decline a task (a dtype or shape the template does not handle).
    """

    name: str
    operators: tuple[str, ...]
    target: str
    render: Callable
    priority: int = 0
    applies: Callable = lambda task: True
    space: Callable[[int], list[dict]] = field(default=lambda level: [{}])
