"""Kiln's settings: every knob of a compile in one object, `Settings`.

Each setting has a default, which an environment variable may give (the field's `env`:
`KILN_TUNE_LEVEL` for `search_space`); an empty variable counts as unset. The variables are
read here and nowhere else. `current()` is the settings in effect: those of the innermost
`patch()` or `applied()` of this context (a thread, a task, a copied context), else the
defaults read from the environment now. A compile resolves its settings once (the torch
backend: `dynamo_config`, torch.compile's mode and options over `current()`), runs under them
with `applied`, and whatever reads a setting on the way (a graph pass, the scheduler, the kernel
cache, the runtime) reads `current()`:

    with kiln.settings.patch(search_space=1, channels_last="always"):
        model = torch.compile(model, backend="kiln")
        model(x)

The fields marked `option` are those torch.compile's `options` and `kiln.torch.dynamo_config`
set (README's table of options lists them); `keyed=False` marks those that change no compiled
plan (logging, dumps, checks, the caches), which the whole-graph cache's keys leave out.
"""
from __future__ import annotations

import contextvars
import functools
import os
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, replace
from typing import Callable, Iterator

LEVELS = ("0", "1", "2")
MODES = ("auto", "always", "never")
"""The values of the settings that are on, off, or decided per graph."""
OFF = ("0", "off", "false", "no")


def _tune_level(text: str) -> int:
    if text not in LEVELS:
        raise ValueError(f"must be 0, 1 or 2, got {text!r}")
    return int(text)


def _unless_zero(text: str) -> bool:
    return text != "0"


def _names(text: str) -> tuple[str, ...]:
    return tuple(n.strip() for n in text.split(",") if n.strip())


def setting(default=None, *, env: str | None = None, parse: Callable[[str], object] = str,
            option: bool = False, keyed: bool = True, default_factory=None):
    """A field of `Settings`: its default, the environment variable giving the default instead
    (`env`, read as `parse(text)`), whether it is an option of the torch backend and whether it
    keys compiled plans."""
    metadata = {"env": env, "parse": parse, "option": option, "keyed": keyed}
    if default_factory is not None:
        return field(default_factory=default_factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def _user_cache() -> str:
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kiln")


@dataclass(frozen=True)
class Settings:
    """One snapshot of every setting (see the module docs)."""

    search_space: int = setting(0, env="KILN_TUNE_LEVEL", parse=_tune_level, option=True)
    """Schedule search of the kernels built: 0 each template's default, 1 a few candidates, 2 many."""
    correctness_report: bool = setting(False, option=True)
    """Print, for each new graph, every node's error against PyTorch on the same inputs."""
    use_cuda_graph: bool = setting(True, option=True)
    """Capture and replay CUDA graphs on NVIDIA GPUs."""
    use_fp16: bool = setting(False, option=True)
    """Compute float32 graphs in float16; inputs and outputs keep the caller's dtype."""
    use_fp16_reduction: bool = setting(False, option=True)
    """Under use_fp16, let operators that sum in float16 keep doing so (else they run in float32)."""
    print_input_graph: bool = setting(False, option=True)
    """Print each graph dynamo hands to the backend."""
    fallback_to_eager: bool = setting(False, option=True)
    """Run operators no rule maps in PyTorch, compiling the rest, instead of raising."""
    allow_tf32: bool = setting(False, option=True)
    """float32 matrix products on CUDA may run on TF32 tensor cores (`kiln.passes.tf32`)."""
    allow_tf32_convolution: bool = setting(False, option=True)
    """float32 convolutions on CUDA may run on TF32 tensor cores (`kiln.passes.tf32`)."""
    graph_cache: bool = setting(True, env="KILN_GRAPH_CACHE", parse=_unless_zero, option=True, keyed=False)
    """Keep compiled graphs' plans on disk and reuse them (`kiln.frontend.torch.graph_cache`)."""
    channels_last: str = setting("auto")
    """Which convolutions start channels-last regions (`kiln.passes.layout.runs_channels_last`):
    "auto", "always" or "never"."""
    nvrtc_check: tuple[str, ...] = setting((), env="KILN_NVRTC_CHECK", parse=_names, keyed=False)
    """GPU architectures ('sm_80', ...) to compile every CPU-built task's CUDA programs for with
    NVRTC, as a check (`kiln.schedule.choose.check_nvrtc`)."""
    reuse_saved_memory: bool = setting(True, env="KILN_REUSE_SAVED_MEMORY", parse=_unless_zero, option=True,
                                       keyed=False)
    """A training backward's CUDA graph puts its gradients and intermediates in the memory of the
    values saved for it once it has read them, where autograd is done with them
    (`kiln.runtime.cuda_graph.capture`)."""
    plan_ahead: str = setting("auto", option=True, keyed=False)
    """After a trace at symbolic sizes whose plan serves other sizes, trace the sizes just past
    its thresholds too (`kiln.frontend.torch.plan_reuse.neighbours`), so that a later call there
    binds a plan instead of tracing and building kernels (a size whose plan serves it alone with
    its sizes compiled in): "auto" for graphs with CUDA inputs, "always" or "never"."""
    dependent_launch: bool = setting(True, env="KILN_DEPENDENT_LAUNCH", parse=_unless_zero)
    """Launch kernels on sm_90 and later as programmatic dependents (`kiln.runtime.dependent_launch`)."""
    dump_dir: str | None = setting(None, env="KILN_DUMP_DIR", keyed=False)
    """Where each compiled graph's stages are kept (`kiln.log.dump_folder`); None: nowhere."""
    graph_cache_mb: int = setting(1024, env="KILN_GRAPH_CACHE_MB", parse=int, keyed=False)
    """The most megabytes the whole-graph cache's entries take."""
    cache_dir: str = setting(env="KILN_CACHE_DIR", keyed=False, default_factory=_user_cache)
    """The kernel cache and the whole-graph cache ($XDG_CACHE_HOME/kiln, else ~/.cache/kiln)."""
    log: str = setting("", env="KILN_LOG", parse=lambda text: text.strip().lower(), keyed=False)
    """The level the `kiln` logger writes to stderr at ('info', 'debug'); '': as the application set it."""
    progress: bool = setting(True, env="KILN_PROGRESS", parse=lambda text: text.strip().lower() not in OFF,
                             keyed=False)
    """Write tuning progress to stderr (`kiln.progress`)."""
    disabled_plugins: tuple[str, ...] = setting((), env="KILN_DISABLE_PLUGINS", parse=_names)
    """Plugins not loaded, by entry-point or distribution name (`kiln.plugins.registry`)."""
    c_compiler: str | None = setting(None, env="CC")
    """The C compiler of the CPU backend (None: gcc, else cc, found on the PATH)."""

    def __post_init__(self):
        if self.search_space not in (0, 1, 2):
            raise ValueError(f"search_space must be 0, 1 or 2, got {self.search_space!r}")
        for name in ("channels_last", "plan_ahead"):
            if getattr(self, name) not in MODES:
                raise ValueError(f"{name} must be one of {', '.join(MODES)}, got {getattr(self, name)!r}")

    @staticmethod
    def from_environment() -> Settings:
        """The defaults, each field's environment variable overriding its own where set (read
        at each call; parsed once for each set of values)."""
        return _parsed(tuple(os.environ.get(name, "") for name in READ))

    def keyed(self) -> dict:
        """The settings that may change a compiled plan, by name."""
        return {name: getattr(self, name) for name in KEYED}


KEYED = tuple(f.name for f in fields(Settings) if f.metadata["keyed"])
"""The settings that may change a compiled plan."""

OPTIONS = tuple(f.name for f in fields(Settings) if f.metadata["option"])
"""The settings torch.compile's `options` and `kiln.torch.dynamo_config` set."""

ENVIRONMENT = {f.metadata["env"]: f.name for f in fields(Settings) if f.metadata["env"]}
"""The environment variables giving defaults, with the setting each gives."""

READ = (*ENVIRONMENT, "XDG_CACHE_HOME", "HOME")
"""Every environment variable the defaults depend on (the last two: `cache_dir`'s default)."""

PARSERS = {f.name: f.metadata["parse"] for f in fields(Settings)}


@functools.lru_cache(maxsize=16)
def _parsed(values: tuple[str, ...]) -> Settings:
    """The settings of the environment whose variables `READ` have `values` (empty: unset)."""
    given = {}
    for (variable, name), text in zip(ENVIRONMENT.items(), values):
        if text:
            try:
                given[name] = PARSERS[name](text)
            except ValueError as error:
                raise ValueError(f"{variable} {error}") from None
    return Settings(**given)

_in_effect: contextvars.ContextVar[Settings | None] = contextvars.ContextVar("kiln_settings", default=None)


def current() -> Settings:
    """The settings in effect here: the innermost `patch()` or `applied()`, else the defaults
    from the environment."""
    found = _in_effect.get()
    return found if found is not None else Settings.from_environment()


@contextmanager
def applied(settings: Settings) -> Iterator[Settings]:
    """A context in which `current()` is `settings`."""
    token = _in_effect.set(settings)
    try:
        yield settings
    finally:
        _in_effect.reset(token)


@contextmanager
def patch(**changes) -> Iterator[Settings]:
    """A context in which `current()` is the settings in effect with `changes` (for tests, and
    for a block of code that needs other settings)."""
    with applied(replace(current(), **changes)) as settings:
        yield settings
