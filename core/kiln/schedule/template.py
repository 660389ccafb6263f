"""Schedule templates: hand-written kernels for the tasks the auto-scheduler cannot make fast."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


@dataclass
class Template:
    """A schedule template for some operators on one target.

    `render(task, **knobs)` returns the target's program (for 'cuda', a
    `kiln.schedule.cuda_program.CudaProgram`); `space(level)` lists the knob settings to try at
    tuning level 0, 1 or 2 (level 0: one default, 1: a few, 2: many). `applies(task)` may
    decline a task (a dtype, layout or shape the template does not handle). `min_arch` is the
    lowest GPU architecture it runs on (90 for Hopper-only instructions), 0 for any.
    Higher `priority` wins among the templates that apply. `suggest(task, sm_count)`, when
    given, ranks knob settings fitted to the task's shape on a GPU of `sm_count`
    multiprocessors (best guess first): tuning level 0 takes its first instead of `space(0)`'s,
    and levels 1 and 2 time its first few alongside `space(level)`.
    """

    name: str
    operators: tuple[str, ...]
    target: str
    render: Callable
    priority: int = 0
    applies: Callable = lambda task: True
    space: Callable[[int], list[dict]] = field(default=lambda level: [{}])
    min_arch: int = 0
    suggest: Callable | None = None
