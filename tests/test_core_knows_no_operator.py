"""The core (`core/kiln`) names no built-in operator (issue 34): no string literal of its source
is the name of an operator kiln-ops-builtin registers, and no module imports kiln_ops_builtin.
What the core needs to know of an operator it reads from the operator's definition (its
traits); passes that exist for particular operators ship with the operators' plugin.

Every module is read with `ast` (nothing of it is imported); docstrings and `__all__` entries
(Python names) are not operator references. In the layers that work on compute IR only
(`kiln.ir`, `kiln.codegen`, `kiln.schedule`, `kiln.runtime`, which test_layering keeps from
importing anything that knows operators), the names of IR opcodes (`add`, `exp`, `argmax`, ...)
are IR, not operators. Beyond that, `ALLOWED` lists the few words that are not operator
references, each with why.
"""
from __future__ import annotations

import ast
from pathlib import Path

import kiln
from kiln.ir.opcodes import BinaryOp, ReduceOp, UnaryOp
from kiln.plugins import registry

ROOT = Path(kiln.__file__).parent
BUILTIN = "kiln-ops-builtin"
IR_LAYERS = ("ir", "codegen", "schedule", "runtime")
IR_WORDS = frozenset(op.value for kind in (UnaryOp, BinaryOp, ReduceOp) for op in kind) | {
    "cast",     # the key of a Cast expression (kiln.ir.expr)
    "var",      # the key of an index variable (kiln.ir.expr)
}

# module (relative to core/kiln) -> {word: why it is not an operator reference}
ALLOWED = {
    "schedule/cuda_split.py": {"split": "the name of the split-reduction kernel rule"},
    "frontend/torch/config.py": {"mode": "torch.compile's `mode` option"},
    "frontend/torch/report.py": {"attention": "a column header of the correctness report"},
    "passes/context.py": {"stack": "a thread-local attribute holding the context stack"},
    "passes/layout.py": dict.fromkeys(("pad", "mode"), "arguments of the operator implementing Role.PAD "
                                                      "(torch.nn.functional.pad's)"),
    "frontend/torch/indices.py": {"index_put": "the name of torch.Tensor's indexing method, not of a Kiln operator"},
    "frontend/torch/aliasing.py": dict.fromkeys(
        ("reshape", "transpose", "permute", "expand", "unsqueeze", "squeeze", "flatten", "as_strided", "split",
         "chunk"),
        "names of torch.Tensor view methods, not of Kiln operators"),
}

def builtin_operator_names() -> set[str]:
    """The names of the operators kiln-ops-builtin contributes, from the plugin registry."""
    names = {c.item.name for c in registry().contributions["operators"] if c.plugin.distribution == BUILTIN}
    assert names, f"{BUILTIN} contributes no operators: is it installed?"
    return names


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def _exports(tree: ast.AST) -> set[int]:
    """The string constants of `__all__ = [...]`."""
    return {id(c) for node in ast.walk(tree) if isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
            for c in ast.walk(node.value) if isinstance(c, ast.Constant)}


def _imports_builtin(node: ast.AST) -> bool:
    if isinstance(node, ast.Import):
        return any(a.name.split(".")[0] == "kiln_ops_builtin" for a in node.names)
    return isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "kiln_ops_builtin"


def offenders() -> dict[str, set[str]]:
    """module (relative to core/kiln) -> the built-in operators it names."""
    names = builtin_operator_names()
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        module = path.relative_to(ROOT).as_posix()
        tree = ast.parse(path.read_text(), str(path))
        skipped = _docstrings(tree) | _exports(tree)
        allowed = set(ALLOWED.get(module, ())) | (IR_WORDS if module.split("/")[0] in IR_LAYERS else set())
        named = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
                 and id(n) not in skipped and n.value in names and n.value not in allowed}
        named |= {"<import>" for n in ast.walk(tree) if _imports_builtin(n)}
        if named:
            found[module] = named
    return found


def test_core_names_no_builtin_operator():
    assert offenders() == {}


def test_allowed_words_are_operator_names():
    """Every allowed word is still needed: it is the name of a built-in operator."""
    names = builtin_operator_names()
    assert {w for words in ALLOWED.values() for w in words} <= names
