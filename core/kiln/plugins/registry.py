"""Plugin discovery: entry points of the group ``kiln``, loaded once, lazily.

`registry()` imports every plugin's entry point on first use (never at ``import kiln``),
collects what each contributes through the hooks of one pluggy manager, and checks every
contribution's type. Whatever goes wrong inside a plugin (an import error, a hook raising or
returning the wrong thing, even `sys.exit()`) is recorded with the distribution's name as that
plugin's load error, and such a plugin contributes nothing; the others load.
`KILN_DISABLE_PLUGINS=a,b` skips plugins by entry point or distribution name (case and
`-`/`_`/`.` do not matter).
"""
from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field
from importlib import metadata

import pluggy

from kiln.plugins import hookspecs
from kiln.plugins.boundary import guarded
from kiln.plugins.contributions import HOOKS, checked
from kiln.settings import current

GROUP = "kiln"


class PluginError(RuntimeError):
    """A conflict between plugins, such as two defining the same operator."""


class OperatorNotFoundError(AttributeError, LookupError):
    """No installed plugin defines the operator asked for."""


@dataclass
class PluginInfo:
    """One discovered plugin and what it contributed."""

    name: str
    distribution: str
    version: str
    contributions: dict[str, list] = field(default_factory=dict)
    error: str | None = None
    disabled: bool = False


@dataclass
class Contribution:
    """One object a plugin contributed, with the plugin it came from."""

    item: object
    plugin: PluginInfo


class Registry:
    """Everything the installed plugins contribute, by hook."""

    def __init__(self):
        self.plugins: list[PluginInfo] = []
        self.contributions: dict[str, list[Contribution]] = {k: [] for k in HOOKS}
        self.operators: dict[str, Contribution] = {}
        self.conflicts: dict[str, str] = {}
        self._jobs: dict | None = None      # job -> {operator name: distribution}, made on first use
        self.manager = pluggy.PluginManager(GROUP)
        self.manager.add_hookspecs(hookspecs)

    @property
    def errors(self) -> list[PluginInfo]:
        return [p for p in self.plugins if p.error]

    def operator(self, name: str):
        """The definition of operator `name`; a clear error if no plugin (or two) define it."""
        if name in self.conflicts:
            raise PluginError(self.conflicts[name])
        found = self.operators.get(name)
        if found is None:
            raise OperatorNotFoundError(f"no installed Kiln plugin provides operator '{name}' ({self._providers()})")
        return found.item

    def implementing(self, job):
        """The definition of the operator whose traits declare `implements=job` (a
        `kiln.graph.Role`, or a function of Python's `operator` module), found by its name, so
        that an override of that operator does the job; a clear error if none or two names do."""
        jobs = self._jobs
        if jobs is None:
            jobs = {}
            for c in self.contributions["operators"]:
                jobs.setdefault(c.item.traits.implements, {})[c.item.name] = c.plugin.distribution
            self._jobs = jobs
        names = jobs.get(job, {})
        shown = getattr(job, "__name__", job)
        if len(names) > 1:
            raise PluginError(f"two operators implement {shown}: "
                              + " and ".join(f"'{n}' of {d}" for n, d in names.items()))
        if not names:
            raise OperatorNotFoundError(f"no installed Kiln plugin provides an operator implementing {shown} "
                                        f"({self._providers()})")
        return self.operator(next(iter(names)))

    def _providers(self) -> str:
        """Which plugins provide operators, and which are missing or disabled (for errors)."""
        providers = [p.distribution for p in self.plugins if "operators" in p.contributions]
        hint = (f"installed operator plugins: {', '.join(providers)}" if providers else
                "no installed plugin provides operators")
        if all(p.distribution != "kiln-ops-builtin" for p in self.plugins):
            hint += "; the built-in operators come with kiln-ops-builtin, which is not installed"
        disabled = [p.distribution for p in self.plugins if p.disabled]
        if disabled:
            hint += f"; disabled by KILN_DISABLE_PLUGINS: {', '.join(disabled)}"
        return hint

    def items(self, kind: str) -> list:
        """The contributed objects of one kind ('schedules', 'torch_mappings', ...)."""
        return [c.item for c in self.contributions[kind]]

    def add_plugin(self, name: str, obj, distribution: str = "", version: str = "") -> PluginInfo:
        """Register a loaded plugin object (a module or any object with hook implementations)
        and collect its contributions; any failure becomes the plugin's `error`."""
        info = PluginInfo(name, distribution or name, version)
        contributions, info.error = guarded(self._collect, name, obj)
        self.plugins.append(info)
        if info.error is None:
            info.contributions = contributions
            for kind, items in contributions.items():
                for item in items:
                    self._add(kind, Contribution(item, info))
        return info

    def _collect(self, name: str, obj) -> dict[str, list]:
        """What `obj`'s hooks return, checked; it stays registered only if all went well."""
        self.manager.register(obj, name=name)
        try:
            self.manager.check_pending()   # a hook implementation of no known hook
            found = {}
            for kind, hook in HOOKS.items():
                for impl in getattr(self.manager.hook, hook).get_hookimpls():
                    if impl.plugin is obj:
                        items = checked(kind, impl.function())
                        if items:
                            found.setdefault(kind, []).extend(items)
            return found
        except BaseException:
            self.manager.unregister(obj, name=name)
            raise

    def _add(self, kind: str, c: Contribution) -> None:
        self.contributions[kind].append(c)
        if kind != "operators":
            return
        self._jobs = None
        name = c.item.name
        prev = self.operators.get(name)
        if prev is not None:
            if getattr(c.item, "override", False) and not getattr(prev.item, "override", False):
                self.operators[name] = c
                return
            if getattr(prev.item, "override", False) and not getattr(c.item, "override", False):
                return
            self.conflicts[name] = (
                f"operator '{name}' is defined by two plugins: {prev.plugin.distribution} "
                f"and {c.plugin.distribution}; uninstall one, disable one with "
                f"KILN_DISABLE_PLUGINS, or mark one definition with override=True")
            return
        if name not in self.conflicts:
            self.operators[name] = c


def normalized(name: str) -> str:
    """A plugin or distribution name compared as pip does: case-insensitive, `-_.` alike."""
    return re.sub(r"[-_.]+", "-", name).lower()


def disabled_names() -> set[str]:
    """The names in KILN_DISABLE_PLUGINS, normalized."""
    return {normalized(n) for n in current().disabled_plugins}


def entry_points() -> list[metadata.EntryPoint]:
    """The installed entry points of the group ``kiln``, by name (read once per discovery)."""
    return _installed()[0]


def plugin_packages() -> frozenset[str]:
    """The top-level import names of the installed plugins' code: each entry point's package
    and the packages its distribution declares (``top_level.txt``)."""
    return _installed()[1]


def _installed() -> tuple[list[metadata.EntryPoint], frozenset[str], list[tuple[str, str]]]:
    """The entry points, the plugins' top-level packages and each entry point's distribution
    name and version, read from the installed metadata once per discovery."""
    global _found
    with _lock:
        if _found is None:
            eps = sorted(metadata.entry_points(group=GROUP), key=lambda e: e.name)
            names = set()
            for ep in eps:
                names.add(ep.module.split(".")[0])
                top_level = ep.dist.read_text("top_level.txt") if ep.dist else None
                names.update(line.strip() for line in (top_level or "").splitlines() if line.strip())
            dists = [(ep.dist.name, ep.dist.version) if ep.dist else (ep.name, "") for ep in eps]
            _found = (eps, frozenset(names), dists)
        return _found


def is_plugin_module(module_name: str) -> bool:
    """Whether the module belongs to an installed plugin's code (enabled, disabled or broken)."""
    return module_name.split(".")[0] in plugin_packages()


def installed() -> list[tuple[metadata.EntryPoint, PluginInfo]]:
    """Each installed entry point of the group ``kiln`` with its plugin's name, distribution,
    version and whether KILN_DISABLE_PLUGINS disables it, read from the installed metadata:
    nothing is imported."""
    disabled = disabled_names()
    found = []
    eps, _, dists = _installed()
    for ep, (dist, version) in zip(eps, dists):
        off = normalized(ep.name) in disabled or normalized(dist) in disabled
        found.append((ep, PluginInfo(ep.name, dist, version, disabled=off)))
    return found


def discover() -> Registry:
    """Load every installed plugin of the entry-point group ``kiln``."""
    reg = Registry()
    for ep, info in installed():
        if info.disabled:
            reg.plugins.append(info)
            continue
        obj, info.error = guarded(ep.load)
        if info.error is not None:
            reg.plugins.append(info)
            continue
        reg.add_plugin(ep.name, obj, info.distribution, info.version)
    return reg


_lock = threading.RLock()
_registry: Registry | None = None
_found: tuple[list[metadata.EntryPoint], frozenset[str], list[tuple[str, str]]] | None = None


def registry() -> Registry:
    """The process-wide registry, discovered on first call."""
    global _registry
    with _lock:
        if _registry is None:
            _registry = discover()
        return _registry


def loaded() -> Registry | None:
    """The process-wide registry where `registry()` has discovered it, else None (and nothing
    is discovered)."""
    with _lock:
        return _registry


def reload() -> Registry:
    """Forget the loaded plugins and discover them again (after installing one, say)."""
    global _registry, _found
    with _lock:
        _registry = _found = None
    return registry()
