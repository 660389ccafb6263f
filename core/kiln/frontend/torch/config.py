"""`kiln.torch.dynamo_config`: the settings of the torch.compile backend.

torch.compile's modes (`MODES`) set some of them: "max-autotune" builds kernels at tuning
level 2 (the tuner times many candidates of each template), "reduce-overhead" replays CUDA
graphs, "default" changes nothing.

Each setter returns the config, so calls chain. Settings are read when a graph first runs
(when its input shapes are known), not when torch.compile is called. Where an environment
variable gives a setting's default (`KILN_GRAPH_CACHE` for `graph_cache`), the setting, once
set, overrides it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace

import torch

MODES = {
    "default": {},
    "reduce-overhead": {"use_cuda_graph": True},
    "max-autotune": {"search_space": 2, "use_cuda_graph": True},
    "max-autotune-no-cudagraphs": {"search_space": 2, "use_cuda_graph": False},
}


@dataclass
class Settings:
    """One snapshot of the backend's settings."""

    search_space: int = 0
    correctness_report: bool = False
    use_cuda_graph: bool = True
    use_fp16: bool = False
    use_fp16_reduction: bool = False
    print_input_graph: bool = False
    fallback_to_eager: bool = False
    allow_tf32: bool = False
    graph_cache: bool | None = None    # None: on unless KILN_GRAPH_CACHE=0


class DynamoConfig:
    """The process-wide settings of backend="kiln" (see the methods for each)."""

    def __init__(self):
        self.settings = Settings()

    def search_space(self, level: int = 2) -> DynamoConfig:
        """Schedule search: 0 uses each template's default, 1 a small space, 2 a large one."""
        if level not in (0, 1, 2):
            raise ValueError(f"search_space must be 0, 1 or 2, got {level!r}")
        self.settings.search_space = level
        return self

    def correctness_report(self, flag: bool = True) -> DynamoConfig:
        """Print, for each new graph, every node's error against PyTorch on the same inputs."""
        self.settings.correctness_report = bool(flag)
        return self

    def use_cuda_graph(self, flag: bool = True) -> DynamoConfig:
        """Capture and replay CUDA graphs on NVIDIA GPUs (on by default)."""
        self.settings.use_cuda_graph = bool(flag)
        return self

    def use_fp16(self, flag: bool = True) -> DynamoConfig:
        """Compute float32 graphs in float16; inputs and outputs keep the caller's dtype."""
        self.settings.use_fp16 = bool(flag)
        return self

    def use_fp16_reduction(self, flag: bool = True) -> DynamoConfig:
        """Accumulate reductions in float16 instead of float32."""
        self.settings.use_fp16_reduction = bool(flag)
        return self

    def print_input_graph(self, flag: bool = True) -> DynamoConfig:
        """Print each graph dynamo hands to the backend (opcode, name, target, args, kwargs)."""
        self.settings.print_input_graph = bool(flag)
        return self

    def fallback_to_eager(self, flag: bool = True) -> DynamoConfig:
        """Run operators no rule maps in PyTorch, compiling the rest, instead of raising."""
        self.settings.fallback_to_eager = bool(flag)
        return self

    def graph_cache(self, flag: bool = True) -> DynamoConfig:
        """Keep compiled graphs' plans on disk and reuse them in later compiles of the same
        graph, inputs, settings and code (`kiln.frontend.torch.graph_cache`); on by default
        unless KILN_GRAPH_CACHE=0."""
        self.settings.graph_cache = bool(flag)
        return self

    def reset(self) -> DynamoConfig:
        """Back to the defaults."""
        self.settings = Settings()
        return self

    def resolve(self, options: dict | None = None, mode: str | None = None) -> Settings:
        """The settings for one compile: these, updated by torch.compile's `mode` (given as
        torch.compile's keyword or as options["mode"]) and `options`; `allow_tf32` is
        torch's `torch.backends.cuda.matmul.allow_tf32` now (dynamo compiles again when it
        changes) unless `options` sets it, and `graph_cache` is KILN_GRAPH_CACHE's where
        neither set it."""
        options = dict(options or {})
        in_options = options.pop("mode", None)
        if mode and in_options and mode != in_options:
            raise ValueError(f"backend 'kiln' got two modes: {mode!r} and options['mode'] = "
                             f"{in_options!r}")
        mode = mode or in_options or "default"
        if mode not in MODES:
            raise ValueError(f"backend 'kiln' does not know mode {mode!r}; "
                             f"expected one of {', '.join(MODES)}")
        known = {f.name for f in fields(Settings)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"backend 'kiln' does not know option(s) {', '.join(unknown)}; "
                             f"expected some of {', '.join(sorted(known))}")
        resolved = replace(self.settings, **{"allow_tf32": torch.backends.cuda.matmul.allow_tf32,
                                             **MODES[mode], **options})
        if resolved.graph_cache is None:
            resolved.graph_cache = os.environ.get("KILN_GRAPH_CACHE", "1") != "0"
        return resolved

    def __repr__(self) -> str:
        return f"DynamoConfig({self.settings})"


dynamo_config = DynamoConfig()
