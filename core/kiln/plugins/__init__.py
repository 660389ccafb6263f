"""Plugins: hook specifications, entry-point discovery, load diagnostics and conflict rules."""
from kiln.plugins.contributions import ContributionError, expect_contributions
from kiln.plugins.hookspecs import hookimpl, hookspec
from kiln.plugins.registry import (
    OperatorNotFoundError, PluginError, PluginInfo, Registry, entry_points, installed, is_plugin_module, loaded,
    registry, reload,
)

__all__ = ["ContributionError", "OperatorNotFoundError", "PluginError", "PluginInfo", "Registry",
           "entry_points", "expect_contributions", "hookimpl", "hookspec", "installed", "is_plugin_module", "loaded",
           "registry", "reload"]
