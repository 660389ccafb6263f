"""Choosing and building a kernel for a Task on a device.

Templates contributed by plugins are tried by priority (highest first) where they apply to the
task's operator and the device's kind; the auto-scheduler's rules handle everything else (see
`kiln.schedule.choose`).
"""
from kiln.schedule.choose import (AUTO_RULES, Template, build_task, choose, device_arch,
                                  schedules_for, templates_for)
from kiln.schedule.session import CompileSession

__all__ = ["AUTO_RULES", "CompileSession", "Template", "build_task", "choose", "device_arch", "schedules_for",
           "templates_for"]
