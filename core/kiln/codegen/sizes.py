"""Symbolic sizes as kernel arguments.

A kernel built for a task with symbolic sizes (`kiln.ir.size`) by a schedule that opts in
takes each size variable as an int64 parameter, and writes every size through it: the kernels
of every size then have one source, built once. `SizeArgs` collects one program's parameters
(each of its kernels declares those it reads: `used_in`), for its emitters (`kiln.codegen.emitter.Emitter(..., sizes=...)`) and for the schedule's own
text (`text`: loop bounds, allocations, template macros). A template whose hooks are rendered
before its own text takes `SizeArgs.of(task)`: every size variable of the task numbered up
front, so the parameter list the hooks declare is already the whole program's.
"""
from __future__ import annotations

import re

from kiln.codegen.emitter import KernelArgs
from kiln.ir.compute import Compute, Task
from kiln.ir.expr import Const, Expr, SizeVar, walk
from kiln.ir.opcodes import BinaryOp
from kiln.ir.size import SymSize

_SIZE_OPS = {BinaryOp.ADD: "+", BinaryOp.SUB: "-", BinaryOp.MUL: "*"}
_SIZE_HELPERS = {BinaryOp.FLOORDIV: "kiln_floordiv_i64", BinaryOp.MOD: "kiln_mod_i64"}


class SizeArgs:
    """The symbolic sizes one program takes as arguments: each distinct size variable is an
    int64 parameter (`KernelArgs.size(k)`), numbered in the order the program's code first
    uses it; `values` are their values in the trace, which its kernels are called with."""

    def __init__(self):
        self._params: dict[tuple[str, int], str] = {}

    @classmethod
    def of(cls, task: Task) -> SizeArgs:
        """The sizes of `task`, every size variable numbered: those of its tensors' shapes in
        the order of `task.nodes()`, then those its expressions read."""
        sizes = cls()
        nodes = task.nodes()
        for node in nodes:
            for size in node.shape:
                sizes.text(size)
        for node in nodes:
            if isinstance(node, Compute):
                for e in walk(node.value):
                    if isinstance(e, SizeVar):
                        sizes.param(e)
        return sizes

    def param(self, var: SizeVar) -> str:
        """The parameter holding `var`."""
        key = (var.name, var.traced)
        found = self._params.get(key)
        if found is None:
            if any(name == var.name for name, _ in self._params):
                raise ValueError(f"size {var.name} has two values in one kernel: "
                                 f"{[v for n, v in self._params if n == var.name]} and {var.traced}")
            found = self._params[key] = KernelArgs.size(len(self._params))
        return found

    def text(self, size) -> str:
        """C text of a size: an int's digits, a SymSize's expression over parameters."""
        if not isinstance(size, SymSize):
            return str(int(size))
        return self._render(size.size_expr())

    def _render(self, e: Expr) -> str:
        if isinstance(e, Const):
            return f"({e.value})" if e.value < 0 else str(e.value)
        if isinstance(e, SizeVar):
            return self.param(e)
        a, b = self._render(e.a), self._render(e.b)
        if e.op in _SIZE_OPS:
            return f"({a} {_SIZE_OPS[e.op]} {b})"
        return f"{_SIZE_HELPERS[e.op]}({a}, {b})"

    @property
    def values(self) -> tuple[int, ...]:
        """The sizes' values in the trace, each as the SymSize of its variable (bound to other
        values where a plan is reused, `kiln.runtime.plan_binding`)."""
        return tuple(SymSize.named(name, value) for name, value in self._params)

    @property
    def names(self) -> list[str]:
        """The parameters' names, in order."""
        return list(self._params.values())

    def declarations(self, names=None) -> list[str]:
        """The parameter declarations of the sizes (of `names` only, when given), in order."""
        return [f"int64_t {name}" for name in (self._params.values() if names is None else names)]

    def used_in(self, text: str) -> list[str]:
        """The parameters that the source `text` reads, in order (one kernel of a program whose
        kernels share these sizes)."""
        return [name for name in self._params.values() if re.search(rf"\b{name}\b", text)]
