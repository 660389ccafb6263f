"""The pattern API for subgraph rewrites.

A pattern is declared from wildcards and operator patterns, and a rewrite function builds the
replacement from the matched tensors and nodes:

    x, w, b = wildcard(), constant(), constant()
    source = op("add", op("matmul", x, w), b, commutative=True)

    @rewrite_pattern("matmul_bias", source)
    def matmul_bias(m):
        if m[b].ndim != 1:
            return None                      # decline: the graph is left as it was
        return kiln.ops.linear(m[x], transposed(m[w]), m[b])

`op(name, *inputs)` matches a node of that operator (or of any of a tuple of names) whose
first tensor inputs match `inputs`; `m[pattern]` is the matched tensor of a wildcard or the
matched node of an operator pattern, and `m.args(pattern)` that node's arguments by name.
Every matched node but the root must have no user outside the match, so a rewrite never
duplicates work. Plugins return RewritePatterns from their `kiln_rewrite_patterns` hook.
"""
from __future__ import annotations

from typing import Callable, Sequence

from kiln.graph import Operator
from kiln.passes.edit import arguments_of, producer
from kiln.tensor import Tensor


class Pattern:
    """A node of a source pattern."""


class Wildcard(Pattern):
    """Any tensor; with `constant=True`, only a constant (concrete) one; with `where`, only one
    for which `where(tensor)` holds."""

    def __init__(self, constant: bool = False, where: Callable[[Tensor], bool] | None = None):
        self.constant = constant
        self.where = where


class OpPattern(Pattern):
    """A node of operator `names` whose first tensor inputs match `inputs`, where `where(node)`."""

    def __init__(self, names, inputs: Sequence[Pattern], commutative: bool = False,
                 where: Callable[[Operator], bool] | None = None):
        self.names = (names,) if isinstance(names, str) else tuple(names)
        self.inputs = list(inputs)
        self.commutative = commutative
        self.where = where


def wildcard(where: Callable[[Tensor], bool] | None = None) -> Wildcard:
    """A pattern matching any tensor (one for which `where(tensor)` holds, when given: of a
    commutative operator's two inputs, the order that satisfies it binds)."""
    return Wildcard(where=where)


def constant() -> Wildcard:
    """A pattern matching a constant tensor (weights, buffers, folded values)."""
    return Wildcard(constant=True)


def op(names, *inputs: Pattern, commutative: bool = False, where=None) -> OpPattern:
    """A pattern matching a node of operator `names` (a name or a tuple of names) whose first
    tensor inputs match `inputs` (in either order for two inputs when `commutative`)."""
    return OpPattern(names, inputs, commutative, where)


class Match:
    """What a pattern matched: `m[p]` is a wildcard's tensor or an operator pattern's node."""

    def __init__(self, bindings: dict):
        self.bindings = bindings

    def __getitem__(self, pattern: Pattern):
        return self.bindings[pattern]

    def args(self, pattern: OpPattern) -> dict:
        """The arguments, by parameter name, of the node `pattern` matched."""
        return arguments_of(self.bindings[pattern])

    @property
    def nodes(self) -> list[Operator]:
        """The matched nodes."""
        return [v for k, v in self.bindings.items() if isinstance(k, OpPattern)]

    @property
    def tensors(self) -> list[Tensor]:
        """The tensors the wildcards matched."""
        return [v for k, v in self.bindings.items() if isinstance(k, Wildcard)]


def _match(p: Pattern, t: Tensor, bound: dict) -> dict | None:
    if p in bound:
        hit = bound[p]
        same = hit is t if isinstance(p, Wildcard) else producer(t) is hit
        return bound if same else None
    if isinstance(p, Wildcard):
        if p.constant and t.is_symbolic or p.where is not None and not p.where(t):
            return None
        return {**bound, p: t}
    node = producer(t)
    if node is None:
        return None
    if (getattr(node, "fused_graph", None) is not None or node.definition.name not in p.names
            or len(node.inputs) < len(p.inputs) or (p.where is not None and not p.where(node))):
        return None
    orders = [p.inputs]
    if p.commutative and len(p.inputs) == 2:
        orders.append(p.inputs[::-1])
    for order in orders:
        found = {**bound, p: node}
        for sub, x in zip(order, node.inputs):
            found = _match(sub, x, found)
            if found is None:
                break
        if found is not None:
            return found
    return None


class RewritePattern:
    """A named source pattern and the function building its replacement.

    `rewrite(match)` returns the tensor (or list of tensors) replacing the root node's outputs,
    or None to decline this match. The pattern's `name` and `opt_level` are checked against
    the PassContext like a pass's.
    """

    def __init__(self, name: str, source: OpPattern, rewrite: Callable[[Match], object],
                 opt_level: int = 1):
        if not isinstance(source, OpPattern):
            raise TypeError(f"pattern '{name}': the source must be an operator pattern (op(...))")
        self.name, self.source, self.rewrite, self.opt_level = name, source, rewrite, opt_level

    def match(self, node: Operator, users: dict, outputs: set) -> Match | None:
        """The match rooted at `node`, or None; interior nodes must be used only inside it."""
        bound = _match(self.source, node.outputs[0], {})
        if bound is None:
            return None
        inside = {id(v) for k, v in bound.items() if isinstance(k, OpPattern)}
        for k, inner in bound.items():
            if not isinstance(k, OpPattern) or inner is node:
                continue
            for t in inner.outputs:
                if id(t) in outputs or any(id(u) not in inside for u in users.get(id(t), ())):
                    return None
        return Match(bound)

    def __repr__(self) -> str:
        return f"<rewrite pattern {self.name} (opt level {self.opt_level})>"


def rewrite_pattern(name: str, source: OpPattern, opt_level: int = 1):
    """Decorator making `rewrite(match)` a RewritePattern of `source`."""
    def wrap(fn):
        return RewritePattern(name, source, fn, opt_level)
    return wrap
