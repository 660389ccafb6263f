"""Plugin discovery: entry points of the group ``kiln``, loaded once, lazily.

`registry()` imports every plugin's entry point on first use (never at ``import kiln``),
collects what each contributes through the hooks, and records load errors with the
distribution's name instead of failing. `KILN_DISABLE_PLUGINS=a,b` skips plugins by entry
point or distribution name.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from importlib import metadata

import pluggy

from kiln.plugins import hookspecs

GROUP = "kiln"
HOOKS = {
    "operators": "kiln_operators",
    "schedules": "kiln_schedules",
    "torch_mappings": "kiln_torch_mappings",
    "graph_passes": "kiln_graph_passes",
    "rewrite_patterns": "kiln_rewrite_patterns",
}


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

    @property
    def errors(self) -> list[PluginInfo]:
        return [p for p in self.plugins if p.error]

    def operator(self, name: str):
        """The definition of operator `name`; a clear error if no plugin (or two) define it."""
        if name in self.conflicts:
            raise PluginError(self.conflicts[name])
        found = self.operators.get(name)
        if found is None:
            providers = [p.distribution for p in self.plugins if "operators" in p.contributions]
            hint = (f"installed operator plugins: {', '.join(providers)}" if providers else
                    "no installed plugin provides operators")
            if all(p.distribution != "kiln-ops-builtin" for p in self.plugins):
                hint += "; the built-in operators come with kiln-ops-builtin, which is not installed"
            disabled = [p.distribution for p in self.plugins if p.disabled]
            if disabled:
                hint += f"; disabled by KILN_DISABLE_PLUGINS: {', '.join(disabled)}"
            raise OperatorNotFoundError(f"no installed Kiln plugin provides operator '{name}' ({hint})")
        return found.item

    def items(self, kind: str) -> list:
        """The contributed objects of one kind ('schedules', 'torch_mappings', ...)."""
        return [c.item for c in self.contributions[kind]]

    def add_plugin(self, name: str, obj, distribution: str = "", version: str = "") -> PluginInfo:
        """Register a loaded plugin object (a module or any object with hook implementations)."""
        info = PluginInfo(name, distribution or name, version)
        pm = pluggy.PluginManager("kiln")
        pm.add_hookspecs(hookspecs)
        try:
            pm.register(obj, name=name)
            for kind, hook in HOOKS.items():
                results = getattr(pm.hook, hook)()
                items = [x for r in results for x in (r or [])]
                if items:
                    info.contributions[kind] = items
        except Exception as exc:  # a broken plugin must not take the others down
            info.error = f"{type(exc).__name__}: {exc}"
            info.contributions = {}
        self.plugins.append(info)
        if not info.error:
            for kind, items in info.contributions.items():
                for item in items:
                    self._add(kind, Contribution(item, info))
        return info

    def _add(self, kind: str, c: Contribution) -> None:
        self.contributions[kind].append(c)
        if kind != "operators":
            return
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


def disabled_names() -> set[str]:
    return {n.strip() for n in os.environ.get("KILN_DISABLE_PLUGINS", "").split(",") if n.strip()}


def discover() -> Registry:
    """Load every installed plugin of the entry-point group ``kiln``."""
    reg = Registry()
    disabled = disabled_names()
    for ep in sorted(metadata.entry_points(group=GROUP), key=lambda e: e.name):
        dist = ep.dist.name if ep.dist else ep.name
        version = ep.dist.version if ep.dist else ""
        if ep.name in disabled or dist in disabled:
            reg.plugins.append(PluginInfo(ep.name, dist, version, disabled=True))
            continue
        try:
            obj = ep.load()
        except Exception as exc:
            reg.plugins.append(PluginInfo(ep.name, dist, version, error=f"{type(exc).__name__}: {exc}"))
            continue
        reg.add_plugin(ep.name, obj, dist, version)
    return reg


_lock = threading.Lock()
_registry: Registry | None = None


def registry() -> Registry:
    """The process-wide registry, discovered on first call."""
    global _registry
    with _lock:
        if _registry is None:
            _registry = discover()
        return _registry


def reload() -> Registry:
    """Forget the loaded plugins and discover them again (after installing one, say)."""
    global _registry
    with _lock:
        _registry = None
    return registry()
