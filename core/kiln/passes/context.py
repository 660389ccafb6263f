"""`PassContext`: the settings graph passes run under (opt level, required and disabled passes,
config, instruments).

    with kiln.PassContext(opt_level=1, disabled_passes=["fuse_operators"],
                          instruments=[PassTiming()]):
        graph = kiln.graph.optimize(graph)

Contexts nest: a setting not given is taken from the enclosing context (config keys one by
one), so a library can set config while the user's opt level and instruments still apply.
`PassContext.current()` is the innermost one of this thread (a default one outside any `with`).
"""
from __future__ import annotations

import threading
from typing import Iterable

DEFAULT_CONFIG = {
    # convert float32 computation to float16 (inputs and outputs keep their types)
    "use_fp16": False,
    # let operators that sum in float16 keep doing so under use_fp16 (otherwise they run in float32)
    "use_fp16_reduction": False,
    # which convolutions start channels-last regions (kiln.passes.layout.runs_channels_last):
    # "auto" (16-bit ones on CUDA that a channels-last template takes), "always" or "never"
    "channels_last": "auto",
    # float32 matrix products on CUDA may run on TF32 tensor cores (kiln.passes.tf32)
    "allow_tf32": False,
}

_local = threading.local()


class PassContext:
    """The settings of one optimization run.

    A pass runs when its name is in `required_passes`, or when it is not in `disabled_passes`
    and its opt level is at most `opt_level` (2 unless an enclosing context says otherwise). `config` overrides `DEFAULT_CONFIG`; passes read
    it with `ctx.config[key]`. `instruments` watch every pass that runs (see
    `kiln.passes.instruments`).
    """

    def __init__(self, opt_level: int | None = None, required_passes: Iterable[str] | None = None,
                 disabled_passes: Iterable[str] | None = None, config: dict | None = None,
                 instruments: Iterable | None = None):
        unknown = set(config or {}) - set(DEFAULT_CONFIG)
        if unknown:
            raise KeyError(f"unknown PassContext config key(s): {', '.join(sorted(unknown))}; "
                           f"known: {', '.join(DEFAULT_CONFIG)}")
        stack = getattr(_local, "stack", None)
        outer = stack[-1] if stack else None
        self.opt_level = opt_level if opt_level is not None else (outer.opt_level if outer else 2)
        self.required_passes = frozenset(required_passes if required_passes is not None else
                                         (outer.required_passes if outer else ()))
        self.disabled_passes = frozenset(disabled_passes if disabled_passes is not None else
                                         (outer.disabled_passes if outer else ()))
        self.config = {**(outer.config if outer else DEFAULT_CONFIG), **(config or {})}
        self.instruments = list(instruments if instruments is not None else
                                (outer.instruments if outer else ()))

    def pass_enabled(self, graph_pass) -> bool:
        """Whether `graph_pass` runs under this context."""
        if graph_pass.name in self.required_passes:
            return True
        if graph_pass.name in self.disabled_passes:
            return False
        return graph_pass.opt_level <= self.opt_level

    @staticmethod
    def current() -> "PassContext":
        """The innermost active context of this thread, or a default one."""
        stack = getattr(_local, "stack", None)
        return stack[-1] if stack else PassContext()

    def __enter__(self) -> "PassContext":
        _local.__dict__.setdefault("stack", []).append(self)
        for inst in self.instruments:
            inst.enter_pass_ctx(self)
        return self

    def __exit__(self, *exc) -> None:
        for inst in self.instruments:
            inst.exit_pass_ctx(self)
        _local.stack.pop()

    def __repr__(self) -> str:
        return (f"PassContext(opt_level={self.opt_level}, required={sorted(self.required_passes)}, "
                f"disabled={sorted(self.disabled_passes)}, config={self.config})")
