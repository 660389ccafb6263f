"""Schedule templates import the core only through `kiln.template`.

Every module of a template package is read with `ast` (nothing is imported); every import
counts, at the top of a module or inside a function. An import of `kiln` or of any `kiln.*`
module other than `kiln.template` fails, and so does a name imported from `kiln.template` that
it does not export. `kiln.template` exports exactly what the templates use: each name of its
`__all__` is imported by at least one of them.
"""
from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import kiln.template

# The template packages held to the rule (a plugin's own modules may import each other freely).
PACKAGES = ["kiln_ops_builtin.templates"]
PUBLIC = "kiln.template"


def modules(package: str) -> dict[str, Path]:
    """Every module of `package` (found, not imported) by dotted name (a package by its own)."""
    spec = importlib.util.find_spec(package)
    found = {}
    for root in spec.submodule_search_locations:
        for path in sorted(Path(root).rglob("*.py")):
            parts = [package, *path.relative_to(root).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def kiln_imports(name: str, source: str, is_package: bool = False) -> list[tuple[int, str, list[str]]]:
    """(line, module, names imported from it) for each import of `kiln` or a `kiln.*` module in
    the module (or package) `name` of `source`; `from kiln import x` counts as an import of
    `kiln.x`."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name if is_package else name.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{base}" if base else package
            if base == "kiln":
                out += [(node.lineno, f"kiln.{alias.name}", []) for alias in node.names]
            else:
                out.append((node.lineno, base, [alias.name for alias in node.names]))
    return [(line, module, names) for line, module, names in out if module == "kiln" or module.startswith("kiln.")]


def violations(name: str, source: str, is_package: bool = False) -> list[str]:
    """What in the module (or package) `name` of `source` breaks the rule, one line each."""
    found = []
    for line, module, names in kiln_imports(name, source, is_package):
        if module != PUBLIC:
            found.append(f"{name}:{line} imports {module} (templates import the core only from {PUBLIC})")
        unknown = sorted(set(names) - set(kiln.template.__all__))
        if unknown:
            found.append(f"{name}:{line} imports {', '.join(unknown)}, which {PUBLIC} does not export")
    return found


TEMPLATES = {name: path for package in PACKAGES for name, path in modules(package).items()}


def test_templates_import_the_core_only_through_kiln_template():
    found = [v for name, path in sorted(TEMPLATES.items())
             for v in violations(name, path.read_text(), path.name == "__init__.py")]
    assert not found, "\n".join(found)


def test_kiln_template_exports_only_what_templates_use():
    used = {n for name, path in TEMPLATES.items()
            for _, module, names in kiln_imports(name, path.read_text(), path.name == "__init__.py")
            if module == PUBLIC for n in names}
    assert not set(kiln.template.__all__) - used, "exported, but imported by no template"
    assert len(set(kiln.template.__all__)) == len(kiln.template.__all__)
    assert all(hasattr(kiln.template, n) for n in kiln.template.__all__)


def test_the_check_catches_what_it_looks_for():
    """The reader on known cases (so that passing means something)."""
    assert len(TEMPLATES) > 20 and "kiln_ops_builtin.templates.gemv" in TEMPLATES
    name = "kiln_ops_builtin.templates.x"
    assert violations(name, "from kiln.template import Template, dtypes\nimport kiln.template\n") == []
    assert violations(name, "from kiln import template\nfrom .split_k import bucket\nimport kiln_ops_builtin\n") == []
    assert len(violations(name, "from kiln import dtypes")) == 1
    assert len(violations(name, "import kiln")) == 1
    assert len(violations(name, "def f():\n    from kiln.codegen import ptx\n")) == 1, "imports inside functions"
    assert len(violations(name, "from kiln.template import NotExported")) == 1
    assert violations("kiln.x", "from .codegen import ptx") == ["kiln.x:1 imports kiln.codegen (templates import "
                                                                 "the core only from kiln.template)"]
    assert violations("kiln.schedule", "from ..template import Template", is_package=True) == []
