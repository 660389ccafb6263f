"""What a schedule template imports from the core: the one public module for template authors.

A template (a plugin's `kiln_schedules()` contribution, CONTRIBUTING.md's "Schedule templates")
imports core names only from here, so that the core may reorganize its modules without
breaking plugins, and a plugin ships a template the same way the built-in ones do
(`tests/test_template_imports.py` holds the built-in templates to it). The names, by group:

Declaring a template
    `Template`: name, operators, target, render function, priority, `applies`, tuning space.

Data types
    `dtypes` (the module: `dtypes.float16`, ...) and `DataType`.

Reading a task (the compute IR)
    What `applies` and the matchers inspect: `Task`, `Compute`, `TensorInput`, the expression
    nodes `Expr`, `Var`, `Const`, `Load`, `Select`, `Binary`, `Unary`, `Cast`, `Reduce`,
    `Check`, `SizeVar`, symbolic sizes `SymSize` (`as_dim`: a size for a launch or a temporary, kept
    symbolic so that a plan binds it to other sizes); building and rewriting expressions: `cast`,
    `as_expr`, `walk`, `rewrite`, `substitute`, `simplify`, `linear_terms`, `unravel`;
    `inline_task` (a task with its buffers inlined into its outputs); `top_reduces` (the
    outermost reductions of an expression).

Matching contractions
    A task as a GEMM whose operands and output the core reads and writes through hooks:
    `match_contraction` / `Contraction` / `Operand` (matmul-like tasks), `match_hooked_gemm` /
    `HookedGemm` (convolutions as implicit GEMM too), `gemm_factors`, `strip_cast`,
    `variables_of`, `unravel_index`.

Fusion hooks (rendered by the core from the IR)
    `render_epilogue` (`kiln_epilogue`: an output element from its accumulator, with whatever
    fusion put after the anchor), `EpilogueSource` / `EpilogueOutput` (what a template that
    stages the epilogue's reads or its stores needs to know), `render_vector_epilogue` /
    `vector_stores` (several neighbouring outputs per store).

Writing kernel source
    `KernelArgs` (kernel parameter and argument names), `Emitter` (an expression as C/CUDA
    statements), `row_major_strides`, `SizeArgs` (symbolic sizes as kernel arguments),
    `CudaDialect` and `CDialect` (types and math of each language), `template_source` (a CUDA
    program in its fixed order: prelude, PTX wrappers, defines, kernels), `c_template_source`
    (a CPU program in its fixed order: the C prelude, defines, hooks, device code), `ptx` (the
    module of PTX wrappers: `cp.async`, `ldmatrix`, `mma.sync`, `wgmma`, mbarriers, TMA,
    thread-block clusters).

Programs and launches
    What `render` returns: `CudaProgram` (source, `Launch`es, temporaries, architecture,
    sizes) with `TensorMapArg` kernel arguments for TMA, or `CpuProgram` with an optional
    `Preparation` (a constant operand laid out once).

Device code and knobs (defined here)
    `device_code(package, *paths)`: `.cuh` or `.h` files shipped with the template's package,
    as text to place in the program (`template_source`'s kernels, `c_template_source`'s code),
    compiler messages pointing into the files. `Knobs`: the base of a template's knobs,
    declared once as a frozen dataclass (fields, level-0 defaults, validity, tuning space per
    level).
"""
from __future__ import annotations

import functools
import importlib.resources
import itertools
from dataclasses import asdict, dataclass

from kiln import dtypes
from kiln.codegen import ptx
from kiln.codegen.c import CDialect, c_template_source
from kiln.codegen.cuda import CudaDialect, template_source
from kiln.codegen.emitter import Emitter, KernelArgs, row_major_strides
from kiln.codegen.epilogue import EpilogueOutput, EpilogueSource, render_epilogue
from kiln.codegen.hooks import (Contraction, HookedGemm, Operand, gemm_factors, match_contraction,
                                match_hooked_gemm, strip_cast, unravel_index, variables_of)
from kiln.codegen.sizes import SizeArgs
from kiln.codegen.vector_epilogue import render_vector_epilogue, vector_stores
from kiln.dtypes import DataType
from kiln.ir import (Binary, Cast, Check, Compute, Const, Expr, Load, Reduce, Select, SizeVar, SymSize, Task,
                     TensorInput, Unary, Var, as_dim, as_expr, cast, inline_task, rewrite, simplify, substitute, unravel)
from kiln.ir.expr import top_reduces, walk
from kiln.ir.simplify import linear_terms
from kiln.runtime.cpu import CpuProgram, Preparation
from kiln.runtime.cuda import CudaProgram, Launch, TensorMapArg
from kiln.schedule import Template

__all__ = [
    # declaring a template
    "Template",
    # data types
    "dtypes", "DataType",
    # reading a task
    "Task", "Compute", "TensorInput", "Expr", "Var", "Const", "Load", "Select", "Binary", "Unary", "Cast", "Reduce",
    "Check", "SizeVar", "SymSize", "as_dim", "cast", "as_expr", "walk", "rewrite", "substitute", "simplify", "linear_terms",
    "unravel", "inline_task", "top_reduces",
    # matching contractions
    "match_contraction", "Contraction", "Operand", "match_hooked_gemm", "HookedGemm", "gemm_factors", "strip_cast",
    "variables_of", "unravel_index",
    # fusion hooks
    "render_epilogue", "EpilogueSource", "EpilogueOutput", "render_vector_epilogue", "vector_stores",
    # writing kernel source
    "KernelArgs", "Emitter", "row_major_strides", "SizeArgs", "CudaDialect", "CDialect",
    "template_source", "c_template_source", "ptx",
    # programs and launches
    "CudaProgram", "Launch", "TensorMapArg", "CpuProgram", "Preparation",
    # device code and knobs
    "device_code", "Knobs",
]


@functools.lru_cache(maxsize=None)
def device_code(package: str, *paths: str) -> str:
    """The text of the files `paths` ('cuda/gemv.cuh'; 'cpu/simd.h', 'cpu/micro.h') of the
    Python package `package` ('kiln_ops_builtin.templates', a template's `__package__`), shipped
    as package data, one after the other, ready to be one of `template_source`'s kernels or
    `c_template_source`'s code: a `#line` directive ahead of each makes compiler messages and
    line info name the file as `kiln_ops_builtin/templates/cuda/gemv.cuh` and its own line
    numbers, and one after the last names what follows `<rendered after ...>`, counting from
    1. The text is in the program, so the kernel cache's key covers it. Read once a process."""
    folder, files = package.replace(".", "/"), importlib.resources.files(package)
    texts = [f'#line 1 "{folder}/{path}"\n{files.joinpath(path).read_text().rstrip()}\n' for path in paths]
    return "".join(texts) + f'#line 1 "<rendered after {folder}/{paths[-1]}>"\n'


@dataclass(frozen=True)
class Knobs:
    """A template's knobs, declared once (in the spirit of Triton's `Config`).

    Subclass it as a frozen dataclass whose fields are the knobs, each with a type and, as its
    default, the value of the level-0 setting (the one used without tuning); override `valid`
    for the settings the kernel supports (constructing any other raises ValueError),
    `space` for the settings the tuner tries at each level (0: one, 1: a few, 2: many) and
    `min_arch` where some settings need a newer GPU than others. `Template` and the tuner
    exchange settings as dicts (`as_dict`, all fields), so the template's `space` is `settings`,
    its `knob_arch` is `setting_arch` and its `render(task, **knobs)` builds `cls(**knobs)`.
    """

    def __post_init__(self):
        if not self.valid():
            raise ValueError(f"{type(self).__name__}: unsupported setting {self.as_dict()}")

    def valid(self) -> bool:
        """Whether the kernel supports this setting (every one, unless overridden)."""
        return True

    def min_arch(self) -> int:
        """The lowest GPU architecture this setting runs on (90: sm_90), 0 for any (unless
        overridden)."""
        return 0

    @classmethod
    def setting_arch(cls, setting: dict) -> int:
        """`min_arch` of a setting given as a dict: a `Template`'s `knob_arch`."""
        return cls(**setting).min_arch()

    @classmethod
    def space(cls, level: int) -> list[Knobs]:
        """The settings to try at tuning `level`: the defaults only, unless overridden."""
        return [cls()]

    @classmethod
    def grid(cls, **choices) -> list[Knobs]:
        """The setting of each combination of `choices` (knob: values), the first knob varying
        slowest, the others at their defaults."""
        return [cls(**dict(zip(choices, values))) for values in itertools.product(*choices.values())]

    @classmethod
    def settings(cls, level: int) -> list[dict]:
        """`space(level)` as dicts: a `Template`'s `space`."""
        return [k.as_dict() for k in cls.space(level)]

    def as_dict(self) -> dict:
        """The setting as `render`'s keyword arguments."""
        return asdict(self)
