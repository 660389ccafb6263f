"""Choosing a schedule for a Task on a target, and building it for a device.

One query consults everything, for every target: the templates that plugins contribute for
the task's operator (`schedules_for`: those that apply, highest priority first), then the
auto-scheduler's rules in order (`AUTO_RULES`: for CUDA column reductions, row kernels, split
reductions, the general kernel; for the CPU row kernels, then one loop nest per buffer). `choose` returns the program of the
first; `build_task` loads it on a device through the runtime backend of the device's kind.

A task that stores rows into its inputs' buffers (`kiln.ir.row_stores`) goes to the last rule
of its target's auto-scheduler, the general one, which writes those stores (templates and the
other rules do not).

A task with symbolic sizes (`kiln.ir.size`) goes as it is to the auto-scheduler, whose rules
take sizes as kernel arguments, and to the templates that do (`Template.symbolic`), so that one
build serves every size; every other template gets it specialized to the trace's sizes
(`kiln.ir.specialize`), and builds a kernel per size.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

from kiln.codegen.hooks import match_contraction
from kiln.device import Device
from kiln.ir.compute import Task
from kiln.ir.inline import inline_task
from kiln.ir.row_stores import row_stores
from kiln.ir.specialize import has_symbolic_sizes, specialize
from kiln.log import logger
from kiln.plugins.registry import Registry, registry
from kiln.runtime import cuda as rt
from kiln.runtime.cache import content_key
from kiln.runtime.backend import CompiledTask, backend_for
import kiln.schedule.tuner as tuner
from kiln.schedule.cpu_auto import schedule as cpu_loop_nests
from kiln.schedule.cpu_rows import schedule as cpu_rows
from kiln.schedule.cuda_columns import schedule as cuda_columns
from kiln.schedule.cuda_transpose import schedule as cuda_transpose
from kiln.schedule.cuda_general import schedule as cuda_general
from kiln.schedule.cuda_rows import schedule as cuda_rows
from kiln.schedule.cuda_split import schedule as cuda_split
from kiln.schedule.store_rows import store_program, stores_rows
from kiln.settings import Settings, current

DEFAULT_SM_COUNT = 132       # what the knobs of a GPU-less build are fitted to (an H100/H200)
MIN_GEMM_SIDE = 16           # a contraction this wide both ways, left to the auto-scheduler, is logged


@dataclass
class Template:
    """A schedule template for some operators on one target ('cpu' or 'cuda').

    `render(task, **knobs)` returns the target's program: for 'cuda' a
    `kiln.runtime.cuda.CudaProgram` (CUDA C++ source, its `Launch`es and temporaries); for 'cpu'
    a `kiln.runtime.cpu.CpuProgram` (C source, the name of the `void` function to call and the
    kernel argument names of its pointer parameters in order, `KernelArgs.args(inputs,
    outputs)`). `space(level)` lists the knob settings to try at tuning level 0, 1 or 2
    (level 0: one default, 1: a few, 2: many). `applies(task)` may decline a task (a dtype,
    layout or shape the template does not handle). `min_arch` is the lowest GPU architecture
    it runs on (90 for Hopper-only instructions), 0 for any. Higher `priority` wins among the
    templates that apply. `reads_views` says that `applies` checks how the task reads its inputs
    (its strides and offsets), so fusion may put views (slices, reshapes, permutes) before the
    template's operator, as index arithmetic the template reads through. `suggest(task, sm_count)`, when given, ranks knob settings fitted to
    the task's shape on a GPU of `sm_count` multiprocessors (best guess first): tuning level 0
    takes its first instead of `space(0)`'s, and levels 1 and 2 time its first few alongside
    `space(level)`. `knob_arch(knobs)` is the lowest GPU architecture a knob setting runs on
    (0: any; a setting using thread-block clusters: 90): of the settings `suggest` and `space`
    list, a GPU is offered only those it runs, so `suggest` may rank a newer GPU's setting
    first. CPU templates are not timed: they run with their level-0 knobs.
    `symbolic` says that `applies` and `render` take tasks with symbolic sizes
    (`kiln.ir.size.SymSize` shapes, `SizeVar`s in expressions) and render kernels that take
    the sizes as arguments (`kiln.codegen.sizes.SizeArgs`), its `suggest` choosing alike for
    the sizes of a bucket so that they share one source; other templates get the task
    specialized to its sizes (`kiln.ir.specialize`), unless `fixed_sizes_only`: such a template
    is not asked about a task with symbolic sizes at all, which then goes to the schedules that
    build once for every size (where a kernel built per size would cost more than it saves).
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
    knob_arch: Callable[[dict], int] = lambda knobs: 0
    reads_views: bool = False
    symbolic: bool = False
    fixed_sizes_only: bool = False

    def task_for(self, task: Task) -> Task:
        """`task` as this template takes it: specialized to its sizes unless `symbolic`."""
        return task if self.symbolic else specialize(task)


AUTO_RULES: dict[str, tuple[Callable, ...]] = {
    "cpu": (cpu_rows, cpu_loop_nests),
    "cuda": (cuda_columns, cuda_transpose, cuda_rows, cuda_split, cuda_general),
}
"""The auto-scheduler of each target: rules tried in order on the lowered task, each returning
its program or None; the last of each takes any task. Every rule takes symbolic sizes as
kernel arguments (`kiln.codegen.sizes`)."""


def templates_for(operator: str, target: str, arch: int | None = None,
                  plugins: Registry | None = None) -> list[Template]:
    """The templates contributed (by `plugins`, the installed ones when not given) for
    `operator` on `target` (that run on a GPU of architecture `arch`, e.g. 90, when given),
    highest priority first."""
    found = [t for t in (plugins or registry()).items("schedules")
             if isinstance(t, Template) and t.target == target and operator in t.operators
             and (arch is None or t.min_arch <= arch)]
    return sorted(found, key=lambda t: -t.priority)


def device_arch(device: Device) -> int | None:
    """The architecture number of `device`'s GPU (90 for sm_90), None for a CPU or where no GPU
    is here (graphs of CUDA symbols are planned for NVRTC checks too: any architecture)."""
    backend = backend_for(device)
    return None if backend.unavailable() else backend.arch(device)


def schedules_for(task: Task, target: str, arch: int | None = None,
                  plugins: Registry | None = None) -> list[Template]:
    """The templates that take `task` on `target` (see `templates_for`), highest priority first;
    none for a task that stores rows (`kiln.ir.row_stores`)."""
    if row_stores(task):
        return []
    symbolic = has_symbolic_sizes(task)
    return [t for t in templates_for(task.name, target, arch, plugins)
            if not (symbolic and t.fixed_sizes_only) and t.applies(t.task_for(task))]


def auto_program(task: Task, target: str):
    """The auto-scheduler's program of `task` on `target`: its first rule's that applies (the
    last rule's for a task that stores rows)."""
    lowered = inline_task(task)
    for rule in AUTO_RULES[target][-1:] if lowered.stores else AUTO_RULES[target]:
        program = rule(lowered)
        if program is not None:
            return program
    raise AssertionError(f"the last {target} rule takes every task, but declined {task!r}")


def choose(task: Task, target: str, arch: int | None = None, knobs: Callable | None = None):
    """The program computing `task` on `target`: the best template that takes it, rendered with
    `knobs(template)` (its level-0 knobs for a GPU of DEFAULT_SM_COUNT multiprocessors and
    architecture `arch` when not given), or the auto-scheduler's."""
    templates = schedules_for(task, target, arch)
    if not templates:
        c = match_contraction(task) if target == "cuda" else None
        if c is not None and min(c.M, c.N) >= MIN_GEMM_SIDE:
            logger.warning("no CUDA template takes %s (%s x %s x %s, %s and %s, strides A %s, B %s): the "
                           "auto-scheduler computes it, far below tensor-core speed", task.name, c.M, c.N, c.K,
                           c.a.dtype, c.b.dtype, (c.a.x_stride, c.a.k_stride), (c.b.x_stride, c.b.k_stride))
        return auto_program(task, target)
    template = templates[0]
    subject = template.task_for(task)
    chosen = knobs(template) if knobs else tuner.candidates(template, subject, DEFAULT_SM_COUNT, 0, arch)[0]
    return template.render(subject, **chosen)


def build_task(task: Task, device: Device, settings: Settings | None = None) -> CompiledTask:
    """The kernel computing `task` on `device`, tuned at `settings.search_space` (the settings
    in effect, `kiln.settings.current()`, when not given); with `settings.nvrtc_check`, a CPU
    build also checks the task's CUDA programs (`check_nvrtc`)."""
    settings = settings or current()
    backend = backend_for(device)
    backend.check_available(f"cannot run '{task.name}' on {device}")
    if stores_rows(task):       # an in-place update's store (kiln.schedule.store_rows)
        if device.kind == "cpu" and settings.nvrtc_check:
            program = store_program(task, "cuda")
            rt.compile_many([(rt.launch_source(program, arch), task.name, program.arch_for(arch))
                             for arch in settings.nvrtc_check])
        return CompiledTask(task, device, backend.load(store_program(task, device.kind), device))
    if device.kind == "cpu" and settings.nvrtc_check:
        check_nvrtc(task, settings.nvrtc_check)
    arch = backend.arch(device)
    program = choose(task, device.kind, arch,
                     lambda template: tuner.tune(template.task_for(task), template, device, settings.search_space, arch))
    return CompiledTask(task, device, backend.load(program, device), program)


def check_nvrtc(task: Task, archs) -> None:
    """Compile with NVRTC, for each of `archs` ('sm_80', ...), the CUDA programs Kiln may build
    for `task`: every applicable template at each knob setting of tuning level 1, and the
    auto-scheduler's program; each from the source the runtime compiles for that architecture
    (`kiln.runtime.cuda.launch_source`). Raises CudaBuildError on the first that fails. Needs no
    GPU.

    A test suite builds the same operators at many sizes, so a process compiles each program
    once for what can change its code, not once a size:

    - the program a template builds by default (its level-0 setting) and the auto-scheduler's,
      once for each form (`program_form`): every code path the tests reach;
    - a template's other settings, once for each operator and operand dtypes: each setting
      compiles, and the code paths that sizes select show in the default setting's."""
    archs = [a.strip() for a in archs]
    operands = (task.name, repr([t.dtype for t in (*task.inputs, *task.outputs)]))
    jobs, keys = [], set()

    def check(name: str, knobs: dict, render: Callable, by: tuple = ()) -> None:
        """Queue `render()`'s program for each arch, unless a program of the same template,
        knobs and `by` (its form when empty) was compiled or queued."""
        setting = repr(sorted(knobs.items()))

        def key(arch, source=None):
            return content_key(arch, name, setting, *(by or (program_form(source),)))
        if by and all(key(arch) in _COMPILED or key(arch) in keys for arch in archs):
            return
        program = render()
        for arch in archs:
            source = rt.launch_source(program, arch)
            compiled = key(arch, source)
            if compiled not in _COMPILED and compiled not in keys and program.min_arch <= rt.arch_number(arch):
                jobs.append((source, f"{task.name}_{name}", program.arch_for(arch)))
            keys.add(compiled)

    for template in schedules_for(task, "cuda"):
        subject = template.task_for(task)
        default = tuner.candidates(template, subject, DEFAULT_SM_COUNT, 0)[0]
        check(template.name, default, lambda: template.render(subject, **default))
        for knobs in tuner.candidates(template, subject, DEFAULT_SM_COUNT, 1):
            if knobs != default:
                check(template.name, knobs, lambda: template.render(subject, **knobs), by=operands)
    check("auto", {}, lambda: auto_program(task, "cuda"))
    rt.compile_many(jobs)
    _COMPILED.update(keys)


_COMPILED: set[str] = set()
_INTEGER = re.compile(r"\b\d+[uUlL]*\b")


def program_form(source: str) -> str:
    """`source` with every integer literal blanked: two programs of one form differ only in
    sizes, strides and other constants, not in their code paths, types or instructions."""
    return _INTEGER.sub("#", source)
