"""Plugins: hook specifications, entry-point discovery, load diagnostics and conflict rules."""
from kiln.plugins.hookspecs import hookimpl, hookspec
from kiln.plugins.registry import (
    OperatorNotFoundError, PluginError, PluginInfo, Registry, registry, reload,
)

__all__ = ["OperatorNotFoundError", "hookimpl", "hookspec", "PluginError", "PluginInfo", "Registry", "registry", "reload"]
