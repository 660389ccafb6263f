"""Choosing and building a kernel for a Task on a device.

Templates contributed by plugins are tried by priority (highest first) where they apply to the
task's operator and the device's kind; the auto-scheduler handles everything else.
"""
from kiln.schedule.build import CompiledTask, build_task
from kiln.schedule.template import Template

__all__ = ["CompiledTask", "Template", "build_task"]
