"""The layers of the core only import downward, and no modules of `kiln` import each other in a
cycle.

Every module of the `kiln` package is read with `ast` (nothing is imported); every import
counts, at the top of a module or inside a function. `from kiln import x` is an import of the
submodule `kiln.x` where there is one; importing `kiln.a.b` also runs the package `kiln.a`,
so it counts as an import of that package too (except for the importer's own packages, which
are already being imported, and the root package `kiln`, which every module runs first).
Folders without `__init__.py` (namespace packages) run nothing.
"""
from __future__ import annotations

import ast
from pathlib import Path

import kiln

# The layers from the bottom up (written once; README.md's "Layers" section says it in words).
# A module may import modules of its own layer and of the layers below it.
LAYERS = [
    ("kiln.dtypes", "kiln.device", "kiln.log", "kiln.progress", "kiln.settings", "kiln.table", "kiln.version"),
    ("kiln.ir",),
    ("kiln.codegen",),
    ("kiln.runtime",),
    ("kiln.plugins",),
    ("kiln.schedule",),
    ("kiln.template",),
    ("kiln.tensor",),
    ("kiln.graph",),
    ("kiln.passes",),
    ("kiln.ops",),
    ("kiln.frontend",),
    ("kiln.torch",),
    ("kiln",),
    ("kiln.cli",),
]

ROOT = Path(kiln.__file__).parent


def module_names() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name)."""
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = module_names()


def is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def is_namespace_package(name: str) -> bool:
    return (ROOT.parent.joinpath(*name.split("."))).is_dir() and name not in MODULES


def layer_of(name: str) -> int:
    """The index in LAYERS of the module `name` (its longest matching prefix)."""
    best = None
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if name == prefix or name.startswith(prefix + "."):
                if best is None or len(prefix) > len(best[1]):
                    best = (index, prefix)
    assert best is not None, f"module {name} is in no layer: add it to LAYERS"
    return best[0]


def resolved(importer: str, node: ast.AST) -> set[str]:
    """The kiln modules one import statement names."""
    names = set()
    if isinstance(node, ast.Import):
        names.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
        if node.level:
            package = importer if is_package(importer) else importer.rpartition(".")[0]
            for _ in range(node.level - 1):
                package = package.rpartition(".")[0]
            base = f"{package}.{node.module}" if node.module else package
        else:
            base = node.module or ""
        names.add(base)
        names.update(f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in MODULES)
    return {n for n in names if n == "kiln" or n.startswith("kiln.")}


def imports_of(name: str) -> set[str]:
    """The kiln modules that running module `name` imports, with the packages they run."""
    tree = ast.parse(MODULES[name].read_text(), str(MODULES[name]))
    own = {name.rsplit(".", k)[0] for k in range(name.count(".") + 1)}  # itself and its packages
    found = set()
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        for target in resolved(name, node):
            while target not in MODULES and not is_namespace_package(target):
                target = target.rpartition(".")[0]      # `kiln.x.Name`: the module holding Name
            if isinstance(node, ast.ImportFrom) and target == "kiln" and not node.level \
                    and all(f"kiln.{a.name}" in MODULES for a in node.names):
                continue        # `from kiln import dtypes`: only the submodules count
            while target and target != "kiln":
                found.add(target)
                target = target.rpartition(".")[0]
    return {t for t in found if t in MODULES and t not in own}


GRAPH = {name: imports_of(name) for name in MODULES}


def test_every_module_has_a_layer():
    for name in MODULES:
        layer_of(name)


def test_no_module_imports_a_layer_above_its_own():
    upward = [f"{name} ({LAYERS[layer_of(name)][0]}) imports {target} ({LAYERS[layer_of(target)][0]})"
              for name, targets in sorted(GRAPH.items()) for target in sorted(targets)
              if layer_of(target) > layer_of(name)]
    assert not upward, "upward imports:\n" + "\n".join(upward)


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative: the components of more than one module, or one that
    imports itself."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_no_import_cycles():
    cycles = strongly_connected(GRAPH)
    assert not cycles, "modules importing each other in a cycle:\n" + "\n".join(
        " <-> ".join(c) for c in cycles)


def test_the_checks_catch_what_they_look_for():
    """The cycle finder and the import reader on known cases (so that passing means something)."""
    assert strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert strongly_connected({"a": {"b"}, "b": set()}) == []
    assert "kiln.passes" in GRAPH["kiln.passes.pipeline"] or "kiln.graph" in GRAPH["kiln.passes.pipeline"]
    assert "kiln.ir.expr" in GRAPH["kiln.ir.compute"]
    assert "kiln.dtypes" in GRAPH["kiln.ir.expr"], "`from kiln import dtypes` is the submodule"
    assert layer_of("kiln.frontend.torch.registry") > layer_of("kiln.plugins.registry")
