"""The `kiln` command.

Each subcommand is one module of this package, named in COMMANDS, that defines:

- `HELP`: a one-line summary for `kiln --help`;
- `configure(parser)`: adds the subcommand's arguments to its argparse parser;
- `run(args) -> int`: does the work and returns the exit status.

Adding a subcommand is adding its module and its name to COMMANDS. A command module imports
what its work needs inside `run`, not at the top, since `kiln` imports every command module.
"""
from __future__ import annotations

import argparse
import importlib

COMMANDS = ("plugins", "cache", "demo", "unmapped")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `kiln` with one subparser per module in COMMANDS."""
    parser = argparse.ArgumentParser(
        prog="kiln", description="Kiln: a deep-learning compiler for PyTorch.")
    parser.add_argument("--version", action="version", version=version_text())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        module = importlib.import_module(f"{__name__}.{name}")
        command = sub.add_parser(name, help=module.HELP, description=module.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
        module.configure(command)
        command.set_defaults(run=module.run)
    return parser


def version_text() -> str:
    """'kiln X (torch Y, Python Z); plugins: A 1.0, B 2.0': the versions of kiln-core and of
    the installed plugin distributions, read from their metadata (nothing is imported)."""
    import platform
    from importlib import metadata

    def version(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    core = version("kiln-core")
    plugins = sorted({f"{ep.dist.name} {ep.dist.version}" for ep in metadata.entry_points(group="kiln")
                      if ep.dist is not None})
    text = f"kiln {core} (torch {version('torch')}, Python {platform.python_version()})"
    return text + (f"; plugins: {', '.join(plugins)}" if plugins else "; no plugins")


def main(argv: list[str] | None = None) -> int:
    """Run `kiln` with `argv` (default: the process's arguments); return the exit status."""
    args = build_parser().parse_args(argv)
    return args.run(args)

