"""The subgraph-rewrite pass: apply rewrite patterns until none matches."""
from __future__ import annotations

from typing import Sequence

from kiln.passes.edit import rebuild, users
from kiln.passes.graph_pass import GraphPass
from kiln.passes.pattern import RewritePattern
from kiln.plugins import registry
from kiln.tensor import Tensor

MAX_ROUNDS = 100


def available_patterns() -> list[RewritePattern]:
    """The installed plugins' patterns, in the order the plugins contribute them."""
    return registry().items("rewrite_patterns")


class RewriteSubgraphs(GraphPass):
    """Replace every match of the enabled patterns (the plugins', or `patterns` when given) by
    its rewrite, round after round until nothing matches."""

    name = "rewrite_subgraphs"
    opt_level = 1

    def __init__(self, patterns: Sequence[RewritePattern] | None = None):
        self.patterns = None if patterns is None else list(patterns)

    def transform(self, graph, ctx):
        patterns = [p for p in (self.patterns if self.patterns is not None else available_patterns())
                    if ctx.pass_enabled(p)]
        for _ in range(MAX_ROUNDS):
            replacements = self._round(graph, patterns)
            if not replacements:
                break
            graph = rebuild(graph, lambda node, inputs: replacements.get(id(node)))
        return graph

    @staticmethod
    def _round(graph, patterns) -> dict[int, list[Tensor]]:
        """Replacements (by node id) for non-overlapping matches, in graph order. A replacement
        reading tensors downstream of another root replaced in this round is built on their
        old versions, and `rebuild` computes it again from the new ones."""
        us, outputs = users(graph), {id(t) for t in graph.outputs}
        claimed: set[int] = set()
        replacements: dict[int, list[Tensor]] = {}
        rooted = _by_root(patterns)
        for node in graph.nodes:
            for pattern in rooted.get(node.definition.name, ()):
                m = pattern.match(node, us, outputs)
                if m is None or any(id(n) in claimed for n in m.nodes):
                    continue
                new = pattern.rewrite(m)
                if new is None:
                    continue
                new = [new] if isinstance(new, Tensor) else list(new)
                _check(pattern, node, new)
                replacements[id(node)] = new
                claimed.update(id(n) for n in m.nodes)
                break
        return replacements


def _by_root(patterns) -> dict[str, list[RewritePattern]]:
    """The patterns (in order) whose root matches a node of each operator name: a node is
    tried against these only, the others' roots refusing its operator."""
    rooted: dict[str, list[RewritePattern]] = {}
    for pattern in patterns:
        for name in dict.fromkeys(pattern.source.names):
            rooted.setdefault(name, []).append(pattern)
    return rooted


def _check(pattern: RewritePattern, node, new: list[Tensor]) -> None:
    old = node.outputs
    if len(new) != len(old) or any(a.shape != b.shape or a.dtype != b.dtype for a, b in zip(new, old)):
        raise ValueError(
            f"rewrite pattern '{pattern.name}' replaced {', '.join(t.signature() for t in old)} "
            f"by {', '.join(t.signature() for t in new)}; a replacement must keep shapes and dtypes")
