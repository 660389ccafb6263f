"""The hook specifications a Kiln plugin implements (any subset of them).

A plugin is an installed distribution with an entry point in the group ``kiln`` whose object
(usually a module) carries functions marked with ``kiln.plugins.hookimpl``.
"""
import pluggy

hookspec = pluggy.HookspecMarker("kiln")
hookimpl = pluggy.HookimplMarker("kiln")


@hookspec
def kiln_operators():
    """Return a list of operator definitions (made with ``kiln.graph.operator``)."""


@hookspec
def kiln_schedules():
    """Return a list of schedule templates (``kiln.schedule.Template``)."""


@hookspec
def kiln_torch_mappings():
    """Return a list of torch mapping rules (made with ``kiln.frontend.torch`` registration)."""


@hookspec
def kiln_graph_passes():
    """Return a list of graph passes (``kiln.passes.GraphPass``)."""


@hookspec
def kiln_rewrite_patterns():
    """Return a list of subgraph rewrite patterns (``kiln.passes.RewritePattern``)."""
