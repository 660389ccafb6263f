"""A new size of a symbolic graph served by the plan traced at an earlier size (issue 33).

A KilnFunction traces its graph again at each new input signature. Where the graph's sizes are
symbolic (`kiln.ir.size.SymSize`), the trace records what it read of their values
(`kiln.ir.size_reads`): the comparisons, as guards, and whether anything else read a value.
A trace that read no value but through its guards, whose plan holds no constant of a symbolic
shape (`kiln.runtime.plan_binding.binds_elsewhere`), made every decision as it would make it at
any sizes where the guards answer the same: its plan, with its sizes evaluated there
(`kiln.runtime.plan_binding.bound`), is what a trace there would plan. `ReusablePlan` keeps such
a plan; `for_call` binds it to a call's sizes where its guards hold, under the same settings.

A size just outside the sizes a plan serves (past a template's threshold or power-of-two
bucket) needs a trace of its own. `neighbours` finds the nearest such sizes below and above a
plan of one size variable, so that the backend can trace them ahead (`Settings.plan_ahead`),
at sizes given by `sizes_at`, where no call is waiting on it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from kiln.frontend.torch.run_record import RunRecord
from kiln.ir.size import SymSize, guard_variables, guards_hold, moved_to, pinned, size_text, value_at, variables
from kiln.ir.size_reads import SizeReads
from kiln.runtime.plan import Plan
from kiln.runtime.plan_binding import binds_elsewhere, bound, symbolic_parts
from kiln.settings import Settings


def fixed_part(args, sizes, positions) -> tuple:
    """What tells the calls `args` (of input `sizes`, see `input_sizes`) apart at `positions`
    but their symbolic sizes' values: a tensor's dtype, device and shape with each symbolic
    dimension as its expression (`size_text`), any other argument as its symbolic size's
    expression or as it is. A plan serves another call only where this is the same."""
    def fixed(size):
        return ("size", size_text(size)) if isinstance(size, SymSize) else size

    return tuple((a.dtype, a.device, tuple(map(fixed, s))) if isinstance(a, torch.Tensor) else fixed(s)
                 for a, s in ((args[k], sizes[k]) for k in positions))


def _each_size(sizes, at) -> list:
    return [tuple(at(d) for d in size) if isinstance(size, tuple) else at(size) for size in sizes]


def sizes_at(sizes, values: dict[str, int]) -> list:
    """Input `sizes` (as `input_sizes` gives them) as they would be in a call with the size
    variables at `values`."""
    return _each_size(sizes, lambda d: moved_to(d, values))


def sizes_fixed_at(sizes, values: dict[str, int]) -> list:
    """Input `sizes` (as `input_sizes` gives them) as ints, the size variables at `values`: the
    sizes of a trace that compiles them in."""
    return _each_size(sizes, lambda d: value_at(d, values))


def size_values(sizes) -> dict[str, int]:
    """The value of each size variable in `sizes` (input sizes as `input_sizes` gives them:
    shapes and ints, symbolic ones as SymSizes), by name."""
    values = {}
    for size in sizes:
        for d in size if isinstance(size, tuple) else (size,):
            if isinstance(d, SymSize):
                values.update(variables(d.polynomial))
    return values


@dataclass
class ReusablePlan:
    """A plan traced at symbolic sizes (`record.plan`, sizes as SymSizes) that read their values
    only through `guards`, made under `settings`."""

    record: RunRecord
    guards: frozenset
    settings: Settings
    symbolic: set[int]      # what binding looks into (`plan_binding.symbolic_parts`)
    names: frozenset        # the size variables the guards read

    @classmethod
    def of(cls, record: RunRecord, reads: SizeReads, settings: Settings) -> ReusablePlan | None:
        """The ReusablePlan of a trace's `record` whose size reads were `reads`, or None where
        the trace read a value otherwise or the plan holds constants of symbolic shapes."""
        if reads.read is not None or not binds_elsewhere(record.plan):
            return None
        names = frozenset(name for guard in reads.guards for name in guard_variables(guard))
        return cls(record, frozenset(reads.guards), settings, symbolic_parts(record.plan), names)

    @classmethod
    def at_one_size(cls, record: RunRecord, values: dict[str, int], settings: Settings) -> ReusablePlan:
        """The ReusablePlan of a trace's `record` made with the sizes compiled in at `values`
        (`sizes_fixed_at`), which serves those sizes alone."""
        return cls(record, frozenset(pinned(name, value) for name, value in values.items()), settings, set(),
                   frozenset(values))

    def serves_one_size(self, values: dict[str, int]) -> bool:
        """Whether this plan, traced with its one size variable at `values`, serves neither the
        sizes next to it nor those a `neighbours` step away: a plan for that size alone, which
        kernels with the size compiled in serve as well and faster."""
        if len(values) != 1 or self.names != values.keys():
            return False
        (name, value), = values.items()
        steps = {1, math.gcd(value, ALIGNMENT_KEPT)}
        return not any(guards_hold(self.guards, {name: value + d}) for step in steps for d in (-step, step)
                       if value + d >= 2)

    def serves(self, values: dict[str, int], settings: Settings) -> bool:
        """Whether a trace with the size variables at `values` under `settings` would make
        this plan: the settings are the same and every guard answers as it did."""
        return settings == self.settings and self.names <= values.keys() and guards_hold(self.guards, values)

    def for_call(self, values: dict[str, int], settings: Settings, key: str | None) -> RunRecord | None:
        """The record of this plan bound to the size variables at `values` for a call whose
        whole-graph key is `key`, or None where a guard answers otherwise there, a guard's size
        is not among `values`, or the settings differ."""
        if not self.serves(values, settings):
            return None
        plan: Plan = bound(self.record.plan, values, self.symbolic)
        return replace(self.record, plan=plan, key=key)


ALIGNMENT_KEPT = 16
"""`neighbours` looks at sizes that share the traced size's largest power-of-two divisor up to
this: past a threshold, a size of the same alignment stands for more sizes than an odd one."""

REACH = 8
"""`neighbours` looks no further than this factor from the traced size: a threshold far away
(int32 indexing, a memory limit) is left to a call that gets there."""


def neighbours(plan: ReusablePlan, values: dict[str, int], ranges: dict | None = None) -> list[dict[str, int]]:
    """The sizes next to the class of sizes that `plan`, traced at `values`, serves: for a plan
    whose guards read the one size variable there is, the nearest values below and above where
    a guard answers otherwise, within its range in `ranges` (name -> (least, most), None where
    unbounded: those dynamo's graph takes, `sizes.size_ranges`; never under 2, as dynamo
    specializes 0 and 1) and within a factor REACH of the traced value, each as values. Sizes are stepped by the traced value's
    power-of-two divisor (up to ALIGNMENT_KEPT), first doubling the step, then halving it back
    to the edge."""
    if len(values) != 1 or plan.names != values.keys():
        return []
    (name, value), = values.items()
    least, most = (ranges or {}).get(name, (None, None))
    least = max(least or 0, 2, value // REACH)
    most = value * REACH if most is None else min(most, value * REACH)
    unit = math.gcd(value, ALIGNMENT_KEPT)

    def served(k: int) -> bool:
        return guards_hold(plan.guards, {name: value + k * unit})

    found = []
    for direction in (-1, 1):
        limit = (value - least if direction < 0 else most - value) // unit
        near, far = 0, 1        # near is served (0: the trace itself)
        while far <= limit and served(direction * far):
            near, far = far, 2 * far
        if far > limit:
            if limit <= near or served(direction * limit):
                continue
            far = limit
        while far - near > 1:   # far is not served: close in on the edge
            middle = (near + far) // 2
            near, far = (middle, far) if served(direction * middle) else (near, middle)
        found.append({name: value + direction * far * unit})
    return found
