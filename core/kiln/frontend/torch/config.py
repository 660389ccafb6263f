"""`kiln.torch.dynamo_config`: the settings of the torch.compile backend.

torch.compile's modes (`MODES`) set some of them: "max-autotune" builds kernels at tuning
level 2 (the tuner times many candidates of each template), "reduce-overhead" replays CUDA
graphs, "default" changes nothing.

Each setter returns the config, so calls chain. The settings are `kiln.settings.Settings`:
those in effect (`kiln.settings.current()`: environment variables as defaults, a
`kiln.settings.patch`) with what was set here, torch.compile's mode and options over them,
resolved when dynamo hands the backend a graph. Where an environment variable gives a setting's
default (`KILN_GRAPH_CACHE` for `graph_cache`), the setting, once set, overrides it.

`FROM_TORCH` lists the settings copied from torch's global flags when dynamo hands over a graph
(its TF32 flags); dynamo's guards cover the matmul flag but not cuDNN's (`UNGUARDED`), so a
compiled graph reads that one again at each call where its plans depend on it
(`DynamoConfig.followed`, `kiln.frontend.torch.backend.KilnFunction`).
"""
from __future__ import annotations

from dataclasses import replace

import torch

from kiln.settings import OPTIONS, Settings, current

FROM_TORCH = {
    "allow_tf32": lambda: torch.backends.cuda.matmul.allow_tf32,
    "allow_tf32_convolution": lambda: torch.backends.cudnn.allow_tf32,
}
"""The settings torch's global flags give, each with its flag's reader: TF32 for float32 matrix
products (`torch.set_float32_matmul_precision("high")` sets that flag too) and for float32
convolutions (cuDNN's flag, True by default)."""
UNGUARDED = ("allow_tf32_convolution",)
"""The settings of FROM_TORCH whose flag dynamo's guards do not cover
(`torch._C._dynamo.guards.GlobalStateGuard` checks the matmul flag, not cuDNN's): changing one
recompiles nothing, so the backend reads it again at each call."""

MODES = {
    "default": {},
    "reduce-overhead": {"use_cuda_graph": True},
    "max-autotune": {"search_space": 2, "use_cuda_graph": True},
    "max-autotune-no-cudagraphs": {"search_space": 2, "use_cuda_graph": False},
}


class DynamoConfig:
    """The process-wide settings of backend="kiln" (see the methods for each): `changes` holds
    those set, by name."""

    def __init__(self):
        self.changes: dict = {}

    @property
    def settings(self) -> Settings:
        """The settings in effect with those set here."""
        return replace(current(), **self.changes)

    def search_space(self, level: int = 2) -> DynamoConfig:
        """Schedule search: 0 uses each template's default, 1 a small space, 2 a large one."""
        if level not in (0, 1, 2):
            raise ValueError(f"search_space must be 0, 1 or 2, got {level!r}")
        self.changes["search_space"] = level
        return self

    def correctness_report(self, flag: bool = True) -> DynamoConfig:
        """Print, for each new graph, every node's error against PyTorch on the same inputs."""
        self.changes["correctness_report"] = bool(flag)
        return self

    def use_cuda_graph(self, flag: bool = True) -> DynamoConfig:
        """Capture and replay CUDA graphs on NVIDIA GPUs (on by default)."""
        self.changes["use_cuda_graph"] = bool(flag)
        return self

    def use_fp16(self, flag: bool = True) -> DynamoConfig:
        """Compute float32 graphs in float16; inputs and outputs keep the caller's dtype."""
        self.changes["use_fp16"] = bool(flag)
        return self

    def use_fp16_reduction(self, flag: bool = True) -> DynamoConfig:
        """Accumulate reductions in float16 instead of float32."""
        self.changes["use_fp16_reduction"] = bool(flag)
        return self

    def print_input_graph(self, flag: bool = True) -> DynamoConfig:
        """Print each graph dynamo hands to the backend (opcode, name, target, args, kwargs)."""
        self.changes["print_input_graph"] = bool(flag)
        return self

    def fallback_to_eager(self, flag: bool = True) -> DynamoConfig:
        """Run operators no rule maps in PyTorch, compiling the rest, instead of raising."""
        self.changes["fallback_to_eager"] = bool(flag)
        return self

    def graph_cache(self, flag: bool = True) -> DynamoConfig:
        """Keep compiled graphs' plans on disk and reuse them in later compiles of the same
        graph, inputs, settings and code (`kiln.frontend.torch.graph_cache`); on by default
        unless KILN_GRAPH_CACHE=0."""
        self.changes["graph_cache"] = bool(flag)
        return self

    def reset(self) -> DynamoConfig:
        """Back to the defaults."""
        self.changes = {}
        return self

    def resolve(self, options: dict | None = None, mode: str | None = None) -> Settings:
        """The settings for one compile: these, updated by torch.compile's `mode` (given as
        torch.compile's keyword or as options["mode"]) and `options`; the settings of
        `FROM_TORCH` are torch's flags now unless `options` sets them (`allow_tf32`:
        `torch.backends.cuda.matmul.allow_tf32`, dynamo compiles again when it changes;
        `allow_tf32_convolution`: `torch.backends.cudnn.allow_tf32`, see `followed`)."""
        options = dict(options or {})
        in_options = options.pop("mode", None)
        if mode and in_options and mode != in_options:
            raise ValueError(f"backend 'kiln' got two modes: {mode!r} and options['mode'] = "
                             f"{in_options!r}")
        mode = mode or in_options or "default"
        if mode not in MODES:
            raise ValueError(f"backend 'kiln' does not know mode {mode!r}; "
                             f"expected one of {', '.join(MODES)}")
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise ValueError(f"backend 'kiln' does not know option(s) {', '.join(unknown)}; "
                             f"expected some of {', '.join(sorted(OPTIONS))}")
        flags = {name: read() for name, read in FROM_TORCH.items()}
        return replace(self.settings, **{**flags, **MODES[mode], **options})

    @staticmethod
    def followed(options: dict | None = None) -> dict:
        """The settings of `UNGUARDED` that a compile under `options` takes from torch's flags
        (those `options` does not set), each with its flag's reader: its compiled graph reads
        them again at each call and compiles again where one changed."""
        return {name: FROM_TORCH[name] for name in UNGUARDED if name not in (options or {})}

    def __repr__(self) -> str:
        return f"DynamoConfig({self.changes})"


dynamo_config = DynamoConfig()
