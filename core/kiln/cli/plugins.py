"""List the installed Kiln plugins: their distribution, version, what each contributes (counts
and names), load errors, disabled plugins and conflicts between plugins.

Exits with status 1 when a plugin failed to load or two plugins conflict.
"""
from __future__ import annotations

import textwrap

from kiln.table import format_table

HELP = "list installed plugins, what they contribute, and load errors"


def configure(parser) -> None:
    parser.add_argument("--no-names", dest="names", action="store_false",
                        help="show only the counts of contributions, not their names")


def item_name(item) -> str:
    """A short name for a contributed object: its `name`, else its `__name__`, else its type."""
    name = getattr(item, "name", None) or getattr(item, "__name__", None)
    return str(name) if name else type(item).__name__


def state(info) -> str:
    """One plugin's state column: what it contributes, or why it contributes nothing."""
    if info.disabled:
        return "disabled (KILN_DISABLE_PLUGINS)"
    if info.error:
        return "failed to load"
    counts = [count(len(items), kind.replace("_", " ")) for kind, items in info.contributions.items()]
    return ", ".join(counts) or "nothing"


def count(n: int, plural: str) -> str:
    """'1 operator', '2 operators', '1 graph pass'."""
    if n != 1:
        return f"{n} {plural}"
    return f"1 {plural[:-2] if plural.endswith('sses') else plural[:-1]}"


def plugin_table(reg, names: bool = True) -> str:
    """The plugin table of `kiln plugins` for registry `reg`."""
    rows = [(p.name, p.distribution, p.version or "-", state(p)) for p in reg.plugins]
    header, *row_lines = format_table(rows, ("plugin", "distribution", "version", "contributes"),
                                      rule=False).splitlines()
    lines = [header]
    for plugin, row in zip(reg.plugins, row_lines):
        lines.append(row)
        if plugin.error:
            lines.append(f"    error: {plugin.error}")
        if names:
            for kind, items in plugin.contributions.items():
                listed = ", ".join(sorted(item_name(i) for i in items))
                lines.extend(textwrap.wrap(f"{kind}: {listed}", width=96, initial_indent="    ",
                                           subsequent_indent="      ", break_on_hyphens=False))
    if not reg.plugins:
        lines.append("no Kiln plugin is installed (entry-point group 'kiln'); "
                     "install kiln-ops-builtin for the built-in operators")
    if reg.conflicts:
        lines.append("")
        lines.append("conflicts:")
        lines.extend(f"  {message}" for message in reg.conflicts.values())
    return "\n".join(lines)


def run(args) -> int:
    from kiln.plugins import registry

    reg = registry()
    print(plugin_table(reg, args.names))
    return 1 if reg.errors or reg.conflicts else 0
